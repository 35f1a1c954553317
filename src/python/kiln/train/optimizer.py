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
    """Levanter's `lr_scheduler`: per cycle a warmup (the first from 0, later ones a re-warmup
    from where the last cycle ended), a stable peak and a decay to the floor; then, with
    `cooldown`, a linear ramp to the floor. One cycle without cooldown: warmup, peak, decay."""
    warmup_and_decay_steps(config, num_train_steps)  # the run's shape, checked
    cooldown = config.cooldown_steps(num_train_steps)
    points = config.cycle_points(num_train_steps - cooldown)
    peak, floor = config.learning_rate, config.learning_rate * config.min_lr_ratio
    schedules: list[optax.Schedule] = []
    boundaries: list[int] = []
    previous_end: Any = 0.0
    decay_phase: optax.Schedule = optax.constant_schedule(peak)
    decay = 0
    for cycle, (start, end) in enumerate(zip(points[:-1], points[1:])):
        steps = end - start
        warmup = min(_steps(config.warmup if cycle == 0 else config.rewarmup, steps), steps)
        if warmup:
            schedules.append(optax.linear_schedule(previous_end, peak, warmup))
            boundaries.append(start + warmup)
        longest = max(steps - warmup, 0)
        asked = longest if config.decay is None else _steps(config.decay, steps)
        decay = min(max(asked, 0), longest)
        stable = steps - warmup - decay
        if stable > 0:
            schedules.append(optax.constant_schedule(peak))
            boundaries.append(start + warmup + stable)
        decay_phase = _decay(config, peak, floor, warmup, decay) if decay else optax.constant_schedule(peak)
        previous_end = decay_phase(decay)
        schedules.append(decay_phase)
        boundaries.append(end)
    if cooldown:
        schedules.append(optax.linear_schedule(decay_phase(decay), floor, cooldown))
    # Each schedule runs from its start (join_schedules passes count - boundary); the last
    # boundary, the end of the last cycle, only matters before a cooldown.
    return optax.join_schedules(schedules, boundaries) if len(schedules) > 1 else schedules[0]


def _decay(
    config: AdamConfig, peak: float, floor: float, warmup: int, steps: int
) -> optax.Schedule:
    return {
        "cosine": lambda: optax.cosine_decay_schedule(peak, steps, alpha=config.min_lr_ratio),
        "linear": lambda: optax.linear_schedule(peak, floor, steps),
        "constant": lambda: optax.constant_schedule(peak),
        "inv_sqrt": lambda: _inv_sqrt_schedule(peak, floor, warmup),  # count: after warmup
    }[config.lr_schedule]()


def _steps(amount: float, steps: int) -> int:
    """Levanter's `_convert_frac_or_steps`: up to 1 a fraction of `steps`, above 1 whole steps."""
    return int(amount * steps) if amount <= 1 else int(amount)


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
