"""The Llama architecture as literals, and the numbers derived from it (parameters, FLOPs).

See docs/model.md for the formulas.
"""

from __future__ import annotations

import dataclasses

from kiln_contract.llama import LlamaArchitecture
from kiln_contract.parsing import check_int


@dataclasses.dataclass(frozen=True, kw_only=True)
class LlamaConfig(LlamaArchitecture):
    """The architecture (the contract's, what `llama(...)` declares) and the vocabulary size,
    which comes from the dataset caches' tokenizer."""

    vocab_size: int

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("vocab_size", self.vocab_size, minimum=1)

    @classmethod
    def for_vocabulary(cls, architecture: LlamaArchitecture, vocab_size: int) -> LlamaConfig:
        fields = dataclasses.fields(LlamaArchitecture)
        return cls(**{f.name: getattr(architecture, f.name) for f in fields}, vocab_size=vocab_size)


def num_parameters(config: LlamaConfig) -> int:
    """Every parameter of `kiln.model.llama.Llama(config)`, embeddings and norms included.

    With tied embeddings the input embedding is the lm head, counted once (in the matmul part).
    """
    input_embedding = 0 if config.tie_embeddings else config.vocab_size * config.hidden_dim
    norms = (2 * config.num_layers + 1) * config.hidden_dim
    return input_embedding + _num_matmul_parameters(config) + norms


def flops_per_token(config: LlamaConfig, seq_len: int, *, causal_halved: bool = False) -> float:
    """Training FLOPs (forward + backward) per token: 6 * N_matmul + 12 * L * T * H * D.

    N_matmul counts the weights used in matrix multiplies (all but the input embedding lookup and
    the norm scales; the lm head is included, tied or not). The attention term counts QK^T and
    AV at full (not causally halved) length T, the convention of PaLM's and Levanter's MFU;
    causal_halved counts half of it, the work a causal kernel does.
    """
    attention = 12 * config.num_layers * seq_len * config.num_heads * config.head_dim
    return float(6 * _num_matmul_parameters(config) + attention / (2 if causal_halved else 1))


def _num_matmul_parameters(config: LlamaConfig) -> int:
    d, kv_dim = config.hidden_dim, config.num_kv_heads * config.head_dim
    attention = d * d + 2 * d * kv_dim + d * d  # q, k, v, o projections
    mlp = 3 * d * config.intermediate_dim  # gate, up, down
    lm_head = config.vocab_size * d
    return config.num_layers * (attention + mlp) + lm_head
