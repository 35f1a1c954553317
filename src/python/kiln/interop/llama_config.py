"""Kiln's LlamaConfig <-> a `transformers` Llama config.json (docs/interop.md, "Conventions").

Export writes every hyper-parameter explicitly: transformers' defaults differ from Kiln's
(rms_norm_eps 1e-6 against 1e-5, rope_theta 10000 against 500000), so a field left out would
load as another model. Two generations of readers are served: transformers 4 (and tools built on
it) read `rope_theta` and `torch_dtype`, transformers 5 reads `rope_parameters` and `dtype`;
both are written, with equal values.

Import reads a config as transformers 5 does (`rope_parameters` first, else the legacy
`rope_theta` / `rope_scaling`; transformers' defaults for the fields it may omit) and refuses,
listing every difference at once, any model whose math Kiln's Llama does not compute.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kiln.interop.errors import InteropError
from kiln.model.config import LlamaConfig

HF_MODEL_TYPE = "llama"
HF_ARCHITECTURE = "LlamaForCausalLM"
EXPORT_DTYPES = ("float32", "bfloat16")

# What transformers' LlamaConfig assumes when config.json leaves these out.
HF_DEFAULTS = {
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
}
REQUIRED_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "max_position_embeddings",
)


@dataclass(frozen=True)
class SpecialTokens:
    """The tokenizer's special token ids, as config.json and generation_config.json name them."""

    bos_id: int | None
    eos_id: int
    pad_id: int | None


def hf_config(config: LlamaConfig, tokens: SpecialTokens, dtype: str) -> dict[str, Any]:
    """config.json of the export: every field LlamaForCausalLM reads, none left to a default."""
    check_export_dtype(dtype)
    rope_theta = float(config.rope_theta)
    return {
        "architectures": [HF_ARCHITECTURE],
        "model_type": HF_MODEL_TYPE,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_dim,
        "intermediate_size": config.intermediate_dim,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_seq_len,
        "rms_norm_eps": float(config.norm_eps),
        "rope_theta": rope_theta,
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "tie_word_embeddings": config.tie_embeddings,
        "initializer_range": float(config.init_std),
        "bos_token_id": tokens.bos_id,
        "eos_token_id": tokens.eos_id,
        "pad_token_id": tokens.pad_id,
        "torch_dtype": dtype,
        "dtype": dtype,
        "use_cache": True,
    }


def check_export_dtype(dtype: str) -> None:
    if dtype not in EXPORT_DTYPES:
        raise InteropError(f"dtype {dtype!r} cannot be exported; choose one of {EXPORT_DTYPES}")


def generation_config(tokens: SpecialTokens) -> dict[str, Any]:
    """generation_config.json: the special tokens `generate` stops at and pads with."""
    return {"bos_token_id": tokens.bos_id, "eos_token_id": tokens.eos_id,
            "pad_token_id": tokens.pad_id}  # fmt: skip


def kiln_config(hf: Mapping[str, Any], *, source: str) -> LlamaConfig:
    """The LlamaConfig of a transformers Llama config.json (`source` names it in errors)."""
    missing = [name for name in REQUIRED_FIELDS if hf.get(name) is None]
    if missing:
        raise InteropError(f"{source}: config.json lacks {', '.join(missing)}")
    differences = _differences(hf)
    if differences:
        raise InteropError(
            f"{source} is not a plain Llama that Kiln computes: " + "; ".join(differences)
        )
    num_heads = hf["num_attention_heads"]
    try:
        return LlamaConfig(
            max_seq_len=hf["max_position_embeddings"],
            hidden_dim=hf["hidden_size"],
            intermediate_dim=hf["intermediate_size"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            num_layers=hf["num_hidden_layers"],
            vocab_size=hf["vocab_size"],
            rope_theta=_rope_theta(hf),
            norm_eps=_get(hf, "rms_norm_eps"),
            tie_embeddings=_get(hf, "tie_word_embeddings"),
            init_std=_get(hf, "initializer_range"),
        )
    except ValueError as e:
        raise InteropError(f"{source}: {e}") from None


def _rope_theta(hf: Mapping[str, Any]) -> float:
    """The RoPE base transformers 5 uses: rope_parameters' if given, else the legacy field."""
    parameters = hf.get("rope_parameters") or {}
    theta = parameters.get("rope_theta", _get(hf, "rope_theta"))
    return float(theta)


def _get(hf: Mapping[str, Any], name: str) -> Any:
    value = hf.get(name)
    return HF_DEFAULTS[name] if value is None else value


def _differences(hf: Mapping[str, Any]) -> list[str]:
    """Every field whose value asks for math Kiln's Llama lacks, as `field=value (why)`."""
    found = []
    if hf.get("model_type") != HF_MODEL_TYPE:
        found.append(f"model_type={hf.get('model_type')!r} (Kiln reads {HF_MODEL_TYPE!r})")
    architectures = hf.get("architectures")
    if architectures is not None and list(architectures) != [HF_ARCHITECTURE]:
        found.append(f"architectures={architectures} (Kiln reads [{HF_ARCHITECTURE!r}])")
    for name in ("attention_bias", "mlp_bias"):
        if hf.get(name):
            found.append(f"{name}=true (Kiln's projections have no biases)")
    if hf.get("sliding_window") is not None and hf.get("use_sliding_window") is not False:
        found.append(f"sliding_window={hf['sliding_window']} (Kiln attends to the whole window)")
    if hf.get("hidden_act", "silu") != "silu":
        found.append(f"hidden_act={hf['hidden_act']!r} (Kiln's MLP is SwiGLU with silu)")
    head_dim = hf.get("head_dim")
    hidden, heads = hf["hidden_size"], hf["num_attention_heads"]
    if head_dim is not None and head_dim * heads != hidden:
        found.append(
            f"head_dim={head_dim} with hidden_size={hidden} and num_attention_heads={heads} "
            f"(Kiln's head_dim is hidden_size / num_attention_heads = {hidden / heads:g})"
        )
    if hf.get("partial_rotary_factor", 1.0) != 1.0:
        found.append(
            f"partial_rotary_factor={hf['partial_rotary_factor']} (Kiln rotates every feature)"
        )
    found += _rope_differences(hf)
    return found


def _rope_differences(hf: Mapping[str, Any]) -> list[str]:
    field = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
    parameters = hf.get(field) or {}
    kind = parameters.get("rope_type", parameters.get("type", "default"))
    found = []
    if kind != "default":
        found.append(f"{field}.rope_type={kind!r} (Kiln has plain RoPE only)")
    legacy, current = hf.get("rope_theta"), (hf.get("rope_parameters") or {}).get("rope_theta")
    if legacy is not None and current is not None and float(legacy) != float(current):
        found.append(
            f"rope_theta={legacy} and rope_parameters.rope_theta={current} disagree "
            "(which one a reader uses depends on its transformers version)"
        )
    return found
