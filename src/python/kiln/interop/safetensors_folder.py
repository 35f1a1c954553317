"""A model's tensors as safetensors files in a folder, in the layout transformers reads.

One file `model.safetensors` when everything fits in one shard; else
`model-00001-of-0000N.safetensors` ... with `model.safetensors.index.json`
({"metadata": {"total_size": bytes}, "weight_map": {tensor name: file}}). A shard holds at most
`max_shard_bytes` of tensor data (transformers' "5GB" is 5 * 10**9 bytes), except a single tensor
larger than that, which gets a shard of its own. Tensors are numpy arrays, bfloat16 ones of jax's
numpy type (ml_dtypes.bfloat16). Each file's metadata says {"format": "pt"}: transformers
refuses safetensors files without it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from kiln.interop.errors import InteropError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
FILE_METADATA = {"format": "pt"}


def write_safetensors(
    folder: Path, tensors: Mapping[str, np.ndarray], max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
) -> list[str]:
    """Writes `tensors` (in their order) into `folder`; returns the file names written."""
    from safetensors.numpy import save_file

    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    shards = _split(tensors, max_shard_bytes)
    if len(shards) == 1:
        save_file(dict(shards[0]), str(folder / SINGLE_FILE), metadata=FILE_METADATA)
        return [SINGLE_FILE]
    names = [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    weight_map = {}
    for name, shard in zip(names, shards):
        save_file(dict(shard), str(folder / name), metadata=FILE_METADATA)
        weight_map.update(dict.fromkeys(shard, name))
    index = {
        "metadata": {"total_size": sum(int(t.nbytes) for t in tensors.values())},
        "weight_map": dict(sorted(weight_map.items())),
    }
    (folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return [*names, INDEX_FILE]


def read_safetensors(folder: Path) -> dict[str, np.ndarray]:
    """Every tensor of the model in `folder`, sharded (with an index) or in one file."""
    if (folder / INDEX_FILE).is_file():
        return _read_sharded(folder)
    if (folder / SINGLE_FILE).is_file():
        return _read_file(folder / SINGLE_FILE)
    raise InteropError(
        f"{folder} has neither {SINGLE_FILE} nor {INDEX_FILE}; Kiln reads safetensors weights "
        "only (re-save a pytorch_model.bin folder with transformers' save_pretrained)"
    )


def _split(tensors: Mapping[str, np.ndarray], max_bytes: int) -> list[dict[str, np.ndarray]]:
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        if shards[-1] and size + tensor.nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += tensor.nbytes
    return shards


def _read_sharded(folder: Path) -> dict[str, np.ndarray]:
    try:
        weight_map = json.loads((folder / INDEX_FILE).read_text())["weight_map"]
    except (ValueError, KeyError, TypeError) as e:
        raise InteropError(f"{folder / INDEX_FILE} is not a safetensors index: {e}") from None
    tensors: dict[str, np.ndarray] = {}
    for file_name in sorted(set(weight_map.values())):
        path = folder / file_name
        if not path.is_file():
            raise InteropError(f"{folder / INDEX_FILE} names {file_name}, which is missing")
        tensors.update(_read_file(path))
    listed, found = set(weight_map), set(tensors)
    if listed != found:
        raise InteropError(
            f"{folder / INDEX_FILE} and its shards disagree: listed but absent "
            f"{sorted(listed - found)[:5]}, present but unlisted {sorted(found - listed)[:5]}"
        )
    return tensors


def _read_file(path: Path) -> dict[str, np.ndarray]:
    import jax.numpy  # noqa: F401  (its ml_dtypes give numpy the "bfloat16" bf16 tensors come as)
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="np") as f:
            return dict(f.get_tensors())
    except (SafetensorError, OSError, KeyError) as e:
        raise InteropError(f"cannot read {path}: {e}") from None
