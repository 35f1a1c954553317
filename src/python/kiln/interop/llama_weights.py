"""Kiln's Llama parameter tree <-> the tensors of transformers' LlamaForCausalLM.

The parameter tree is the nested dict `flax.nnx.to_pure_dict` gives for `kiln.model.llama.Llama`
({"blocks": {0: {"attention": {"q_proj": {"kernel": array}}}}, "embed": {"embedding": ...}});
the tensors are the flat `{name: array}` of a safetensors state dict.

One table (`parameter_table`) drives both directions. Kiln's kernels are [in, out] (y = x @ W)
and torch's Linear weights [out, in] (y = x @ W.T): every projection is transposed and nothing
else changes. No q/k permutation: both models rotate feature i with feature i + head_dim / 2
(transformers' `rotate_half`), and both lay heads out head-major (head h owns features
h * head_dim ... (h + 1) * head_dim - 1), grouped-query heads included.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from kiln.interop.errors import InteropError
from kiln.model.config import LlamaConfig

Params = dict[Any, Any]  # nested like nnx.to_pure_dict(state): str keys, int keys for blocks
KilnPath = tuple[Any, ...]

# Buffers some transformers versions saved beside the weights: derived, never read.
DERIVED_TENSOR_SUFFIXES = (".rotary_emb.inv_freq",)


@dataclass(frozen=True)
class ParameterMapping:
    kiln_path: KilnPath
    hf_name: str
    kiln_shape: tuple[int, ...]
    transposed: bool  # a projection kernel: Kiln [in, out], transformers [out, in]

    @property
    def hf_shape(self) -> tuple[int, ...]:
        return self.kiln_shape[::-1] if self.transposed else self.kiln_shape


def parameter_table(config: LlamaConfig) -> list[ParameterMapping]:
    """Every parameter of Llama(config), in transformers' state-dict order."""
    d, f, v = config.hidden_dim, config.intermediate_dim, config.vocab_size
    q_dim, kv_dim = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    table = [ParameterMapping(("embed", "embedding"), "model.embed_tokens.weight", (v, d), False)]
    for i in range(config.num_layers):
        block, layer = ("blocks", i), f"model.layers.{i}"
        projections = [
            ("attention", "q_proj", "self_attn", (d, q_dim)),
            ("attention", "k_proj", "self_attn", (d, kv_dim)),
            ("attention", "v_proj", "self_attn", (d, kv_dim)),
            ("attention", "o_proj", "self_attn", (q_dim, d)),
            ("mlp", "gate_proj", "mlp", (d, f)),
            ("mlp", "up_proj", "mlp", (d, f)),
            ("mlp", "down_proj", "mlp", (f, d)),
        ]
        table.append(ParameterMapping(
            (*block, "attention_norm", "scale"), f"{layer}.input_layernorm.weight", (d,), False
        ))  # fmt: skip
        table += [
            ParameterMapping(
                (*block, module, name, "kernel"), f"{layer}.{hf_module}.{name}.weight", shape, True
            )  # fmt: skip
            for module, name, hf_module, shape in projections
        ]
        table.append(ParameterMapping(
            (*block, "mlp_norm", "scale"), f"{layer}.post_attention_layernorm.weight", (d,), False
        ))  # fmt: skip
    table.append(ParameterMapping(("final_norm", "scale"), "model.norm.weight", (d,), False))
    if not config.tie_embeddings:
        table.append(ParameterMapping(("lm_head", "kernel"), "lm_head.weight", (d, v), True))
    return table


def to_hf_tensors(params: Params, config: LlamaConfig, dtype: np.dtype) -> dict[str, np.ndarray]:
    """The state dict of LlamaForCausalLM(config) in `dtype`, in state-dict order. Each value is
    converted to float32 first, then rounded once to `dtype`."""
    flat = _flatten(params)
    table = parameter_table(config)
    _check_paths(set(flat), {m.kiln_path for m in table}, config)
    tensors = {}
    for m in table:
        value = np.asarray(flat[m.kiln_path], np.float32)
        if value.shape != m.kiln_shape:
            raise InteropError(
                f"parameter {_path_name(m.kiln_path)} has shape {value.shape}; LlamaConfig "
                f"{config} gives {m.kiln_shape}"
            )
        value = value.T if m.transposed else value
        tensors[m.hf_name] = np.ascontiguousarray(value.astype(dtype))
    return tensors


def from_hf_tensors(
    tensors: Mapping[str, np.ndarray], config: LlamaConfig, *, source: str
) -> Params:
    """Kiln's float32 parameter tree from a LlamaForCausalLM state dict (`source` names it)."""
    table = parameter_table(config)
    expected = {m.hf_name for m in table}
    unexpected = sorted(
        name for name in set(tensors) - expected if not name.endswith(DERIVED_TENSOR_SUFFIXES)
    )
    if config.tie_embeddings and "lm_head.weight" in unexpected:
        _check_tied_head(tensors, source)
        unexpected.remove("lm_head.weight")
    missing = sorted(expected - set(tensors))
    if unexpected or missing:
        raise InteropError(
            f"{source} does not hold the tensors of a plain Llama with its config.json"
            + (f"; unexpected: {_listing(unexpected)}" if unexpected else "")
            + (f"; missing: {_listing(missing)}" if missing else "")
        )
    params: Params = {}
    for m in table:
        value = np.asarray(tensors[m.hf_name])
        if value.shape != m.hf_shape:
            raise InteropError(
                f"{source}: tensor {m.hf_name} has shape {value.shape}, but its config.json "
                f"gives {m.hf_shape}"
            )
        value = value.astype(np.float32)
        _set(params, m.kiln_path, np.ascontiguousarray(value.T if m.transposed else value))
    return params


def _check_tied_head(tensors: Mapping[str, np.ndarray], source: str) -> None:
    """A tied model may still carry lm_head.weight; it must then be the embedding itself."""
    head, embedding = tensors["lm_head.weight"], tensors["model.embed_tokens.weight"]
    if head.shape != embedding.shape or not np.array_equal(head, embedding):
        raise InteropError(
            f"{source}: config.json says tie_word_embeddings=true, but lm_head.weight differs "
            "from model.embed_tokens.weight; set tie_word_embeddings=false to read both"
        )


def _check_paths(found: set[KilnPath], expected: set[KilnPath], config: LlamaConfig) -> None:
    missing = sorted(map(_path_name, expected - found))
    extra = sorted(map(_path_name, found - expected))
    if missing or extra:
        raise InteropError(
            f"the parameters are not those of Llama({config})"
            + (f"; missing: {_listing(missing)}" if missing else "")
            + (f"; not in that model: {_listing(extra)}" if extra else "")
        )


def _flatten(params: Mapping[Any, Any], prefix: KilnPath = ()) -> dict[KilnPath, Any]:
    flat: dict[KilnPath, Any] = {}
    for key, value in params.items():
        if isinstance(value, Mapping):
            flat.update(_flatten(value, (*prefix, key)))
        else:
            flat[(*prefix, key)] = value
    return flat


def _set(params: Params, path: KilnPath, value: np.ndarray) -> None:
    node = params
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1]] = value


def _path_name(path: KilnPath) -> str:
    return "/".join(map(str, path))


def _listing(names: list[str], limit: int = 6) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")
