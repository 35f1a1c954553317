"""The Llama architecture: what `llama(...)` declares in a BUILD file and `config.model` holds.

The vocabulary size is not part of it: it comes from the dataset caches' tokenizer, and the
runtime's `kiln.model.config.LlamaConfig` adds it. Defaults are Levanter's `LlamaConfig`'s, but
for `rope_theta` (Levanter's default is 10000) and the initialisation (docs/training.md,
"Kiln and Levanter").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from kiln_contract.parsing import (
    SpecError,
    check_bool,
    check_choice,
    check_int,
    check_number,
    read_json,
    scalar_json,
)

A = TypeVar("A", bound="LlamaArchitecture")

# How the weights are drawn (kiln.model.llama, kiln.model.levanter_init): `normal`, every matrix
# from normal(init_std); `levanter`, Levanter's own draws, value for value for the same seed.
INITIALIZATIONS = ("normal", "levanter")

_SIZES = ("max_seq_len", "hidden_dim", "intermediate_dim", "num_heads", "num_kv_heads", "num_layers")


@dataclass(frozen=True)
class LlamaArchitecture:
    max_seq_len: int
    hidden_dim: int
    intermediate_dim: int
    num_heads: int
    num_kv_heads: int
    num_layers: int
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02
    initialization: str | None = None  # None: "normal" (and absent from the JSON)

    def __post_init__(self) -> None:
        for size in _SIZES:
            check_int(size, getattr(self, size), minimum=1)
        for scale in ("rope_theta", "norm_eps", "init_std"):
            check_number(scale, getattr(self, scale), positive=True)
        check_bool("tie_embeddings", self.tie_embeddings)
        if self.initialization is not None:
            check_choice("initialization", self.initialization, INITIALIZATIONS)
        if self.initialization == "levanter" and self.init_std != 0.02:
            raise SpecError(
                "init_std",
                f"{self.init_std} has no effect with initialization='levanter' (Levanter scales "
                "each matrix by its fan-in); remove it",
            )
        if self.hidden_dim % self.num_heads:
            raise SpecError(
                "hidden_dim",
                f"{self.hidden_dim} is not divisible by num_heads ({self.num_heads})",
            )
        if self.num_heads % self.num_kv_heads:
            raise SpecError(
                "num_heads",
                f"{self.num_heads} is not a multiple of num_kv_heads ({self.num_kv_heads}), "
                "as grouped-query attention needs",
            )
        if self.head_dim % 2:
            raise SpecError(
                "hidden_dim",
                f"head_dim = hidden_dim / num_heads = {self.head_dim} must be even (RoPE "
                "rotates pairs of features)",
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_dim // self.num_heads

    @classmethod
    def from_json(cls: type[A], obj: Any, where: str = "model") -> A:
        return read_json(cls, obj, where)

    def to_json(self) -> dict[str, Any]:
        # An unset initialization is left out, so the JSON (and fingerprint) of every model
        # declared without it is what it was before the field existed.
        values = scalar_json(self)
        if values["initialization"] is None:
            del values["initialization"]
        return values



# Parameter and FLOP counts (docs/model.md): the plugin prices runs with them (`pants plan`),
# the runtime reports MFU with them.


# Fields that do not change the weights: how a fresh model is initialised, and the longest
# sequence the run uses (RoPE has no table to outgrow), so a run may train shorter or longer than
# the weights it starts from.
WEIGHTS_ALIKE = ("init_std", "initialization", "max_seq_len")


def weights_differences(declared: Mapping[str, Any], weights: Mapping[str, Any]) -> list[str]:
    """`field: model=A, weights=B` for each field of an architecture's JSON (a LlamaArchitecture's,
    or a runtime LlamaConfig's with its vocab_size) that makes weights of `weights` unfit for a
    model `declared`."""
    return [
        f"{name}: model={declared[name]!r}, weights={weights.get(name)!r}"
        for name in declared
        if name not in WEIGHTS_ALIKE and declared[name] != weights.get(name)
    ]


def num_parameters(model: LlamaArchitecture, vocab_size: int) -> int:
    """Every parameter of the model with a vocabulary of `vocab_size`, embeddings and norms
    included. With tied embeddings the input embedding is the lm head, counted once (in the
    matmul part)."""
    input_embedding = 0 if model.tie_embeddings else vocab_size * model.hidden_dim
    norms = (2 * model.num_layers + 1) * model.hidden_dim
    return input_embedding + num_matmul_parameters(model, vocab_size) + norms


def flops_per_token(
    model: LlamaArchitecture, vocab_size: int, seq_len: int, *, causal_halved: bool = False
) -> float:
    """Training FLOPs (forward + backward) per token: 6 * N_matmul + 12 * L * T * H * D.

    N_matmul counts the weights used in matrix multiplies (all but the input embedding lookup and
    the norm scales; the lm head is included, tied or not). The attention term counts QK^T and
    AV at full (not causally halved) length T, the convention of PaLM's and Levanter's MFU;
    causal_halved counts half of it, the work a causal kernel does.
    """
    attention = 12 * model.num_layers * seq_len * model.num_heads * model.head_dim
    matmuls = 6 * num_matmul_parameters(model, vocab_size)
    return float(matmuls + attention / (2 if causal_halved else 1))


def num_matmul_parameters(model: LlamaArchitecture, vocab_size: int) -> int:
    d, kv_dim = model.hidden_dim, model.num_kv_heads * model.head_dim
    attention = d * d + 2 * d * kv_dim + d * d  # q, k, v, o projections
    mlp = 3 * d * model.intermediate_dim  # gate, up, down
    return model.num_layers * (attention + mlp) + vocab_size * d  # and the lm head
