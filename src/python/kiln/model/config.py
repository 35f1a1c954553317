"""The Llama architecture as literals, and the numbers derived from it (parameters, FLOPs).

See docs/model.md for the formulas.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    max_seq_len: int
    hidden_dim: int
    intermediate_dim: int
    num_heads: int
    num_kv_heads: int
    num_layers: int
    vocab_size: int
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02

    def __post_init__(self) -> None:
        for name in (
            "max_seq_len",
            "hidden_dim",
            "intermediate_dim",
            "num_heads",
            "num_kv_heads",
            "num_layers",
            "vocab_size",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"LlamaConfig.{name} must be a positive integer, got {value!r}")
        for name in ("rope_theta", "norm_eps", "init_std"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"LlamaConfig.{name} must be a positive number, got {value!r}")
        if not isinstance(self.tie_embeddings, bool):
            raise ValueError(
                f"LlamaConfig.tie_embeddings must be true or false, got {self.tie_embeddings!r}"
            )
        if self.hidden_dim % self.num_heads:
            raise ValueError(
                f"LlamaConfig.hidden_dim ({self.hidden_dim}) must be divisible by "
                f"num_heads ({self.num_heads})"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"LlamaConfig.num_heads ({self.num_heads}) must be divisible by "
                f"num_kv_heads ({self.num_kv_heads}) for grouped-query attention"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"LlamaConfig head_dim = hidden_dim / num_heads = {self.head_dim} must be even "
                "(RoPE rotates pairs of features)"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_dim // self.num_heads

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> LlamaConfig:
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - set(fields))
        if unknown:
            raise ValueError(
                f"unknown LlamaConfig field(s) {unknown}; known fields: {sorted(fields)}"
            )
        missing = sorted(
            name
            for name, f in fields.items()
            if f.default is dataclasses.MISSING and name not in values
        )
        if missing:
            raise ValueError(f"LlamaConfig is missing required field(s) {missing}")
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def num_parameters(config: LlamaConfig) -> int:
    """Every parameter of `kiln.model.llama.Llama(config)`, embeddings and norms included.

    With tied embeddings the input embedding is the lm head, counted once (in the matmul part).
    """
    input_embedding = 0 if config.tie_embeddings else config.vocab_size * config.hidden_dim
    norms = (2 * config.num_layers + 1) * config.hidden_dim
    return input_embedding + _num_matmul_parameters(config) + norms


def flops_per_token(config: LlamaConfig, seq_len: int) -> float:
    """Training FLOPs (forward + backward) per token: 6 * N_matmul + 12 * L * T * H * D.

    N_matmul counts the weights used in matrix multiplies (all but the input embedding lookup and
    the norm scales; the lm head is included, tied or not). The attention term counts QK^T and
    AV at full (not causally halved) length T, the convention of PaLM's and Levanter's MFU.
    """
    attention = 12 * config.num_layers * seq_len * config.num_heads * config.head_dim
    return float(6 * _num_matmul_parameters(config) + attention)


def _num_matmul_parameters(config: LlamaConfig) -> int:
    d, kv_dim = config.hidden_dim, config.num_kv_heads * config.head_dim
    attention = d * d + 2 * d * kv_dim + d * d  # q, k, v, o projections
    mlp = 3 * d * config.intermediate_dim  # gate, up, down
    lm_head = config.vocab_size * d
    return config.num_layers * (attention + mlp) + lm_head
