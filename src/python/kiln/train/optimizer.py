"""AdamW as Levanter configures it: clip -> Adam -> masked decoupled weight decay -> -lr * schedule.

See docs/model.md ("Optimizer") for the schedule's shape.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from kiln_contract.adam import AdamConfig


def warmup_and_decay_steps(config: AdamConfig, num_train_steps: int) -> tuple[int, int]:
    """(warmup steps, decay steps); between them the learning rate holds at its peak."""
    if num_train_steps <= 0:
        raise ValueError(f"num_train_steps must be > 0, got {num_train_steps}")
    return config.schedule_steps(num_train_steps)  # a SpecError (a ValueError) if they overflow


def learning_rate_schedule(config: AdamConfig, num_train_steps: int) -> optax.Schedule:
    """Linear warmup from 0, constant peak, then decay over the last `decay` steps."""
    warmup, decay = warmup_and_decay_steps(config, num_train_steps)
    peak, floor = config.learning_rate, config.learning_rate * config.min_lr_ratio
    stable = num_train_steps - warmup - decay
    decay_phase = {
        "cosine": optax.cosine_decay_schedule(peak, max(decay, 1), alpha=config.min_lr_ratio),
        "linear": optax.linear_schedule(peak, floor, max(decay, 1)),
        "constant": optax.constant_schedule(peak),
        "inv_sqrt": _inv_sqrt_schedule(peak, floor, warmup),  # count: steps after warmup
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


# Levanter's InvSqrtLrSchedule's default timescale (levanter/optim/config.py).
INV_SQRT_TIMESCALE = 10000


def _inv_sqrt_schedule(peak: float, floor: float, warmup: int) -> optax.Schedule:
    # Levanter's _inv_sqrt_decay_schedule: the peak until warmup + s reaches the timescale, then
    # peak * sqrt(timescale / (warmup + s)), never below the floor.
    def schedule(count: jax.Array) -> jax.Array:
        steps = jnp.maximum(count + warmup, 1)
        decay = jnp.minimum(1.0, 1.0 / jnp.sqrt(steps / INV_SQRT_TIMESCALE))
        return jnp.maximum(peak * decay, floor)

    return schedule
