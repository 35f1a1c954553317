"""AdamW as Levanter configures it: clip -> Adam -> masked decoupled weight decay -> -lr * schedule.

See docs/model.md ("Optimizer") for the schedule's shape.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import optax

LR_SCHEDULES = ("cosine", "linear", "constant", "inv_sqrt")


@dataclasses.dataclass(frozen=True)
class AdamConfig:
    learning_rate: float = 6e-4
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    epsilon: float = 1e-8
    max_grad_norm: float | None = 1.0  # None: no clipping
    warmup: float = 0.01  # < 1: fraction of num_train_steps; >= 1: steps
    decay: float | None = None  # None: decay from the end of warmup to the end; else like warmup
    min_lr_ratio: float = 0.1
    lr_schedule: str = "cosine"

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            optional = f.name in ("max_grad_norm", "decay")
            if f.name != "lr_schedule" and not (optional and value is None):
                _require(
                    isinstance(value, (int, float)) and not isinstance(value, bool),
                    f.name,
                    "must be a number",
                    value,
                )
        _require(self.learning_rate > 0, "learning_rate", "must be > 0", self.learning_rate)
        _require(self.weight_decay >= 0, "weight_decay", "must be >= 0", self.weight_decay)
        _require(0 <= self.beta1 < 1, "beta1", "must be in [0, 1)", self.beta1)
        _require(0 <= self.beta2 < 1, "beta2", "must be in [0, 1)", self.beta2)
        _require(self.epsilon > 0, "epsilon", "must be > 0", self.epsilon)
        _require(
            self.max_grad_norm is None or self.max_grad_norm > 0,
            "max_grad_norm",
            "must be > 0 or null",
            self.max_grad_norm,
        )
        _require(self.warmup >= 0, "warmup", "must be >= 0", self.warmup)
        _require(self.decay is None or self.decay >= 0, "decay", "must be >= 0 or null", self.decay)
        _require(
            0 <= self.min_lr_ratio <= 1, "min_lr_ratio", "must be in [0, 1]", self.min_lr_ratio
        )
        _require(
            self.lr_schedule in LR_SCHEDULES,
            "lr_schedule",
            f"must be one of {LR_SCHEDULES}",
            self.lr_schedule,
        )

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> AdamConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(
                f"unknown AdamConfig field(s) {unknown}; known fields: {sorted(known)}"
            )
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def warmup_and_decay_steps(config: AdamConfig, num_train_steps: int) -> tuple[int, int]:
    """(warmup steps, decay steps); between them the learning rate holds at its peak."""
    if num_train_steps <= 0:
        raise ValueError(f"num_train_steps must be > 0, got {num_train_steps}")
    warmup = _steps(config.warmup, num_train_steps)
    if warmup > num_train_steps:
        raise ValueError(
            f"AdamConfig.warmup ({config.warmup}) is {warmup} steps, more than "
            f"num_train_steps ({num_train_steps})"
        )
    decay = (
        num_train_steps - warmup if config.decay is None else _steps(config.decay, num_train_steps)
    )
    if warmup + decay > num_train_steps:
        raise ValueError(
            f"AdamConfig warmup + decay = {warmup} + {decay} steps exceeds "
            f"num_train_steps ({num_train_steps})"
        )
    return warmup, decay


def learning_rate_schedule(config: AdamConfig, num_train_steps: int) -> optax.Schedule:
    """Linear warmup from 0, constant peak, then decay over the last `decay` steps."""
    warmup, decay = warmup_and_decay_steps(config, num_train_steps)
    peak, floor = config.learning_rate, config.learning_rate * config.min_lr_ratio
    stable = num_train_steps - warmup - decay
    decay_phase = {
        "cosine": optax.cosine_decay_schedule(peak, max(decay, 1), alpha=config.min_lr_ratio),
        "linear": optax.linear_schedule(peak, floor, max(decay, 1)),
        "constant": optax.constant_schedule(peak),
        "inv_sqrt": _inv_sqrt_schedule(peak, floor, warmup),
    }[config.lr_schedule]
    phases = [optax.linear_schedule(0.0, peak, warmup), optax.constant_schedule(peak), decay_phase]
    return optax.join_schedules(phases, boundaries=[warmup, warmup + stable])


def weight_decay_mask(params: Any) -> Any:
    """True for the weights of linear layers (named "kernel"), the lm head included as in
    Levanter; False for embeddings, norm scales and biases."""

    def is_kernel(path: tuple, _: Any) -> bool:
        names = [key.key for key in path if isinstance(key, jax.tree_util.DictKey)]
        return bool(names) and names[-1] == "kernel"

    return jax.tree_util.tree_map_with_path(is_kernel, params)


def build_optimizer(config: AdamConfig, num_train_steps: int) -> optax.GradientTransformation:
    clip = [] if config.max_grad_norm is None else [optax.clip_by_global_norm(config.max_grad_norm)]
    return optax.chain(
        *clip,
        optax.scale_by_adam(b1=config.beta1, b2=config.beta2, eps=config.epsilon),
        optax.add_decayed_weights(config.weight_decay, mask=weight_decay_mask),
        optax.scale_by_learning_rate(learning_rate_schedule(config, num_train_steps)),
    )


def _inv_sqrt_schedule(peak: float, floor: float, warmup: int) -> optax.Schedule:
    # peak * sqrt(w / (w + s)) for s steps after warmup, never below the floor.
    timescale = max(warmup, 1)

    def schedule(count: jax.Array) -> jax.Array:
        return jnp.maximum(floor, peak * jnp.sqrt(timescale / (timescale + count)))

    return schedule


def _steps(amount: float, num_train_steps: int) -> int:
    return int(amount * num_train_steps) if amount < 1 else int(math.floor(amount))


def _require(ok: bool, field: str, rule: str, value: Any) -> None:
    if not ok:
        raise ValueError(f"AdamConfig.{field} {rule}, got {value!r}")
