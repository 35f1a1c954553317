"""A `transformers` Llama config.json read as Kiln's architecture, by both halves: the runtime
imports weights with it (kiln.interop.llama_config), and `pants plan` checks an `init_from`
folder's config against the run's `model` before anything is built.

It reads a config as transformers 5 does (`rope_parameters` first, else the legacy `rope_theta` /
`rope_scaling`; transformers' defaults for the fields it may omit) and refuses, listing every
difference at once, any model whose math Kiln's Llama does not compute.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

HF_MODEL_TYPE = "llama"
HF_ARCHITECTURE = "LlamaForCausalLM"

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


class NotPlainLlama(ValueError):
    """The config is not a Llama Kiln computes, or lacks a field (the message names them all)."""


def config_fields(hf: Mapping[str, Any], *, source: str) -> dict[str, Any]:
    """The architecture of a config.json as Kiln names it (LlamaArchitecture's fields, and
    vocab_size); `source` names the file in errors."""
    missing = [name for name in REQUIRED_FIELDS if hf.get(name) is None]
    if missing:
        raise NotPlainLlama(f"{source}: config.json lacks {', '.join(missing)}")
    differences = _differences(hf)
    if differences:
        raise NotPlainLlama(
            f"{source} is not a plain Llama that Kiln computes: " + "; ".join(differences)
        )
    num_heads = hf["num_attention_heads"]
    return {
        "max_seq_len": hf["max_position_embeddings"],
        "hidden_dim": hf["hidden_size"],
        "intermediate_dim": hf["intermediate_size"],
        "num_heads": num_heads,
        "num_kv_heads": hf.get("num_key_value_heads") or num_heads,
        "num_layers": hf["num_hidden_layers"],
        "vocab_size": hf["vocab_size"],
        "rope_theta": _rope_theta(hf),
        "norm_eps": _get(hf, "rms_norm_eps"),
        "tie_embeddings": _get(hf, "tie_word_embeddings"),
        "init_std": _get(hf, "initializer_range"),
    }


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


def kiln_run_advice(folder: str, record: Mapping[str, Any]) -> str | None:
    """What to do instead when an `init_from` folder holds a Kiln run (its artifact.json), not a
    transformers model; None for any other record."""
    if record.get("kind") not in ("lm_checkpoint", "hf_model"):
        return None
    ref = f"{record.get('name')}@{record.get('version')}"
    return (
        f"{folder} is a Kiln {record['kind']}'s folder ({ref}), not a transformers model: start "
        "from it by its target's address, `init_from=':target'` (or `from_checkpoint(':target', "
        "step=N)`), so that the graph builds it first and sees it change"
    )
