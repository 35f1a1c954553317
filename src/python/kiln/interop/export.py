"""A Kiln checkpoint as a `transformers` Llama folder (docs/interop.md).

`export_run(run_dir, out)` reads a finished (or running) lm_checkpoint's folder: its model
config (config.json), the parameters of one complete checkpoint, and the tokenizer of its
dataset caches, which must be the one the run recorded (same digest). `write_hf_llama` writes the
folder: config.json, generation_config.json, safetensors weights (sharded, with an index, past
`max_shard_bytes`) and the tokenizer's files.

Nothing is half-written: everything goes into a hidden staging folder beside `out`, each file is
flushed to disk, and the staging folder is renamed to `out` last. An `out` that exists is refused.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from kiln.artifacts import RECORD_FILE, SUCCESS
from kiln.artifacts.atomic import atomic_write_json
from kiln.artifacts.folder import ArtifactFolder
from kiln.interop.errors import InteropError
from kiln.interop.llama_config import (
    SpecialTokens,
    check_export_dtype,
    generation_config,
    hf_config,
)
from kiln.interop.llama_weights import Params, to_hf_tensors
from kiln.interop.safetensors_folder import DEFAULT_MAX_SHARD_BYTES, write_safetensors
from kiln.model.config import LlamaConfig


def export_run(
    run_dir: Path,
    out: Path,
    *,
    step: int | str = "last",
    dtype: str = "float32",
    tokenizer_dir: Path | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    record: dict[str, Any] | None = None,
) -> Path:
    """Exports checkpoint `step` ("last": the newest complete one) of the run at `run_dir`;
    with `record`, as an artifact of the store (see write_hf_llama)."""
    from kiln.interop.trained_run import TrainedRun

    run_dir, out = Path(run_dir), Path(out)
    _check_free(out)
    check_export_dtype(dtype)
    run = TrainedRun.open(run_dir)
    try:
        checkpoint = run.checkpoint(step)
        tokenizer = run.tokenizer(tokenizer_dir)
        check_vocabulary(run.model_config, tokenizer.info)  # before the (long) restore
        params = run.params(checkpoint)
    finally:
        run.close()
    return write_hf_llama(
        out,
        run.model_config,
        params,
        tokenizer,
        dtype=dtype,
        max_shard_bytes=max_shard_bytes,
        record=record,
    )


def write_hf_llama(
    out: Path,
    config: LlamaConfig,
    params: Params,
    tokenizer: Any,
    *,
    dtype: str = "float32",
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    record: dict[str, Any] | None = None,
) -> Path:
    """Writes Llama(config)'s `params` with `tokenizer` (a kiln.data.tokenizer.LoadedTokenizer)
    as a transformers Llama folder at `out`, atomically. float32 keeps the parameters exactly;
    bfloat16 rounds each float32 value once (round to nearest even). With `record`, the folder
    is an artifact of the store: `record` as its artifact.json, then STATUS SUCCESS, last."""
    out = Path(out)
    _check_free(out)
    check_export_dtype(dtype)
    check_vocabulary(config, tokenizer.info)
    tensors = to_hf_tensors(params, config, np.dtype(_numpy_dtype(dtype)))
    tokens = special_tokens(tokenizer)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.staging-"))
    try:
        write_safetensors(staging, tensors, max_shard_bytes)
        tokenizer.hf_tokenizer.save_pretrained(str(staging))
        _write_json(staging / "config.json", hf_config(config, tokens, dtype))
        _write_json(staging / "generation_config.json", generation_config(tokens))
        if record is not None:
            atomic_write_json(staging / RECORD_FILE, record)
            ArtifactFolder.at(staging).write_status(SUCCESS)
        _flush_files(staging)
        os.rename(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def special_tokens(tokenizer: Any) -> SpecialTokens:
    """BOS and PAD as the tokenizer declares them; EOS as Kiln frames documents with it."""
    hf = tokenizer.hf_tokenizer
    return SpecialTokens(bos_id=hf.bos_token_id, eos_id=tokenizer.info.eos_id,
                         pad_id=hf.pad_token_id)  # fmt: skip


def check_vocabulary(config: LlamaConfig, tokenizer_info: Any) -> None:
    """The embedding must have one row per token of the tokenizer, added tokens included."""
    if config.vocab_size != tokenizer_info.vocab_size:
        raise InteropError(
            f"the model's vocab_size is {config.vocab_size} but tokenizer {tokenizer_info.name!r} "
            f"has {tokenizer_info.vocab_size} tokens; export it with the tokenizer it was "
            "trained with"
        )


def _check_free(out: Path) -> None:
    if out.exists():
        raise InteropError(f"{out} already exists; remove it or export to another folder")


def _numpy_dtype(dtype: str) -> Any:
    if dtype == "bfloat16":
        import jax.numpy as jnp

        return jnp.bfloat16  # ml_dtypes' numpy bfloat16
    return np.float32


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def _flush_files(folder: Path) -> None:
    """fsync every file, so that the rename never publishes a folder of truncated files."""
    for path in folder.rglob("*"):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
