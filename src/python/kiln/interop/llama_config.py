"""Kiln's LlamaConfig <-> a `transformers` Llama config.json (docs/interop.md, "Conventions").

Export writes every hyper-parameter explicitly: transformers' defaults differ from Kiln's
(rms_norm_eps 1e-6 against 1e-5, rope_theta 10000 against 500000), so a field left out would
load as another model. Two generations of readers are served: transformers 4 (and tools built on
it) read `rope_theta` and `torch_dtype`, transformers 5 reads `rope_parameters` and `dtype`;
both are written, with equal values.

Import reads a config with kiln_contract.hf_llama (shared with `pants plan`'s check of an
`init_from` folder): as transformers 5 does, refusing any model whose math Kiln's Llama does not
compute.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kiln.interop.errors import InteropError
from kiln.model.config import LlamaConfig
from kiln_contract.hf_llama import HF_ARCHITECTURE, HF_MODEL_TYPE, NotPlainLlama, config_fields

EXPORT_DTYPES = ("float32", "bfloat16")


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
    try:
        return LlamaConfig(**config_fields(hf, source=source))
    except NotPlainLlama as e:
        raise InteropError(str(e)) from None
    except ValueError as e:
        raise InteropError(f"{source}: {e}") from None
