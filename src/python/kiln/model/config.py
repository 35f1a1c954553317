"""The Llama architecture as literals, and the numbers derived from it (parameters, FLOPs).

See docs/model.md for the formulas.
"""

from __future__ import annotations

import dataclasses

from kiln_contract import llama
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
    """Every parameter of `kiln.model.llama.Llama(config)` (kiln_contract.llama's count)."""
    return llama.num_parameters(config, config.vocab_size)


def flops_per_token(config: LlamaConfig, seq_len: int, *, causal_halved: bool = False) -> float:
    """Training FLOPs per token of `config` (kiln_contract.llama's count)."""
    return llama.flops_per_token(config, config.vocab_size, seq_len, causal_halved=causal_halved)
