"""Validation loss and bits-per-byte over fixed windows of each validation cache.

Metrics (Marin's names): eval/{name}/loss (mean next-token cross-entropy, nats), eval/{name}/bpb,
and across sets eval/loss and eval/bpb (token- and byte-weighted over all sets together),
eval/macro_loss and eval/macro_bpb (the unweighted mean over sets).

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


def validation_metrics(eval_fn: EvalFn, sets: Sequence[ValidationSet]) -> dict[str, float]:
    metrics: dict[str, float] = {}
    nats_total = tokens_total = bytes_total = 0.0
    for vs in sets:
        nats = tokens = 0.0
        for batch in vs.batches:
            out = eval_fn(batch)
            nats += float(out["loss_sum"])
            tokens += float(out["token_count"])
        metrics[f"eval/{vs.name}/loss"] = nats / tokens
        metrics[f"eval/{vs.name}/bpb"] = nats / (math.log(2) * vs.target_bytes)
        nats_total, tokens_total, bytes_total = (
            nats_total + nats, tokens_total + tokens, bytes_total + vs.target_bytes
        )  # fmt: skip
    if sets:
        metrics["eval/loss"] = nats_total / tokens_total
        metrics["eval/bpb"] = nats_total / (math.log(2) * bytes_total)
        metrics["eval/macro_loss"] = float(np.mean([metrics[f"eval/{s.name}/loss"] for s in sets]))
        metrics["eval/macro_bpb"] = float(np.mean([metrics[f"eval/{s.name}/bpb"] for s in sets]))
    return metrics
