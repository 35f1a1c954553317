"""Validation loss and bits-per-byte over fixed windows of each validation cache.

Metrics (Levanter's names, as Marin logs them): per set, named like `paloma/c4_en`,
eval/{name}/loss (mean next-token cross-entropy, nats) and eval/{name}/bpb. Each `/`-prefix of a
name is a group (`paloma`): eval/{group}/macro_loss and macro_bpb (the unweighted mean over its
sets), eval/{group}/micro_loss and eval/{group}/bpb (token- and byte-weighted over its sets
together). Over all sets: eval/loss, eval/bpb (weighted) and eval/macro_loss, eval/macro_bpb.

bits-per-byte = sum of CE nats / (ln 2 x sum of the UTF-8 byte lengths of the predicted target
tokens), counting exactly the positions the loss counts (loss_mask). It compares models with
different tokenizers, which loss per token cannot.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kiln_contract.vocabulary import eval_groups

Batch = dict[str, np.ndarray]
# (batch) -> {"loss_sum": CE nats summed over loss_mask, "token_count": sum of loss_mask}
EvalFn = Callable[[Batch], Mapping[str, Any]]


def predicted_target_bytes(batch: Batch, token_byte_lengths: np.ndarray) -> int:
    """UTF-8 bytes of the tokens the loss predicts: tokens[t+1] wherever loss_mask[t] is 1."""
    targets = batch["tokens"][:, 1:]
    counted = batch["loss_mask"][:, :-1] > 0
    return int(token_byte_lengths[targets][counted].sum())


@dataclass(frozen=True)
class ValidationSet:
    name: str
    batches: tuple[Batch, ...]
    target_bytes: int  # over all batches

    @classmethod
    def build(
        cls, name: str, batches: Sequence[Batch], token_byte_lengths: np.ndarray
    ) -> ValidationSet:
        total = sum(predicted_target_bytes(b, token_byte_lengths) for b in batches)
        if total <= 0:
            raise ValueError(f"validation set {name}: its windows predict no bytes; cannot do bpb")
        return cls(name, tuple(batches), total)


@dataclass(frozen=True)
class _Totals:
    """One set's sums: cross-entropy nats, predicted tokens, their UTF-8 bytes."""

    nats: float
    tokens: float
    bytes: float

    @property
    def loss(self) -> float:
        return self.nats / self.tokens

    @property
    def bpb(self) -> float:
        return self.nats / (math.log(2) * self.bytes)


def _set_totals(eval_fn: EvalFn, vs: ValidationSet) -> _Totals:
    nats = tokens = 0.0
    for batch in vs.batches:
        out = eval_fn(batch)
        nats += float(out["loss_sum"])
        tokens += float(out["token_count"])
    return _Totals(nats, tokens, vs.target_bytes)


def _averages(totals: Sequence[_Totals]) -> dict[str, float]:
    """Macro (the mean of each set's value) and micro (pooled) averages over some sets."""
    pooled = _Totals(*(sum(getattr(t, k) for t in totals) for k in ("nats", "tokens", "bytes")))
    return {
        "macro_loss": float(np.mean([t.loss for t in totals])),
        "macro_bpb": float(np.mean([t.bpb for t in totals])),
        "micro_loss": pooled.loss,
        "bpb": pooled.bpb,
    }


def validation_metrics(eval_fn: EvalFn, sets: Sequence[ValidationSet]) -> dict[str, float]:
    totals = {vs.name: _set_totals(eval_fn, vs) for vs in sets}
    metrics: dict[str, float] = {}
    for name, t in totals.items():
        metrics[f"eval/{name}/loss"] = t.loss
        metrics[f"eval/{name}/bpb"] = t.bpb
    members: dict[str, list[_Totals]] = {}
    for name, t in totals.items():
        for group in eval_groups(name):
            members.setdefault(group, []).append(t)
    for group, group_totals in sorted(members.items()):
        metrics.update({f"eval/{group}/{k}": v for k, v in _averages(group_totals).items()})
    if totals:
        overall = _averages(list(totals.values()))
        overall["loss"] = overall.pop("micro_loss")  # Levanter logs the overall micro as `loss`
        metrics.update({f"eval/{k}": v for k, v in overall.items()})
    return metrics
