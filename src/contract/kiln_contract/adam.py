"""AdamW as Levanter configures it: what `adam(...)` declares and `config.optimizer` holds.

kiln.train.optimizer turns it into optax transformations; docs/model.md has the schedule's shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kiln_contract.parsing import (
    SpecError,
    check_choice,
    check_number,
    check_optional,
    read_json,
    scalar_json,
)

LR_SCHEDULES = ("cosine", "linear", "constant", "inv_sqrt")


@dataclass(frozen=True)
class AdamConfig:
    learning_rate: float = 6e-4
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    epsilon: float = 1e-8
    max_grad_norm: float | None = 1.0  # None: no clipping
    warmup: float = 0.01  # <= 1: fraction of num_train_steps; > 1: whole steps (as Levanter)
    decay: float | None = None  # None: from the end of warmup to the end; else like warmup
    min_lr_ratio: float = 0.1
    lr_schedule: str = "cosine"
    # Levanter's cycles (kiln.train.optimizer): `cycles` N equal cycles, or the steps where
    # cycles end; each after the first re-warms from where the last ended over `rewarmup`
    # (a fraction of the cycle, or steps). `cooldown` (a fraction of the run, or steps): a
    # last linear ramp to the floor after the cycles. Unset, the schedule is one cycle.
    rewarmup: float = 0.0
    cycles: int | tuple[int, ...] | None = None
    cooldown: float | None = None

    def __post_init__(self) -> None:
        check_number("learning_rate", self.learning_rate, positive=True)
        check_number("weight_decay", self.weight_decay, minimum=0)
        check_number("beta1", self.beta1, minimum=0, below=1)
        check_number("beta2", self.beta2, minimum=0, below=1)
        check_number("epsilon", self.epsilon, positive=True)
        check_optional(check_number, "max_grad_norm", self.max_grad_norm, positive=True)
        check_number("warmup", self.warmup, minimum=0)
        check_optional(check_number, "decay", self.decay, minimum=0)
        check_number("rewarmup", self.rewarmup, minimum=0)
        check_optional(check_number, "cooldown", self.cooldown, minimum=0)
        self._check_cycles()
        for name in ("warmup", "decay", "rewarmup", "cooldown"):
            amount = getattr(self, name)
            if amount is not None and amount > 1 and amount % 1:
                raise SpecError(
                    name,
                    f"{amount} is neither a fraction of the run (<= 1) nor a whole number of steps",
                )
        check_number("min_lr_ratio", self.min_lr_ratio, minimum=0, maximum=1)
        check_choice("lr_schedule", self.lr_schedule, LR_SCHEDULES)

    def _check_cycles(self) -> None:
        if isinstance(self.cycles, list):  # as BUILD files and JSON write it
            object.__setattr__(self, "cycles", tuple(self.cycles))
        if self.cycles is None:
            return
        if isinstance(self.cycles, bool) or not isinstance(self.cycles, (int, tuple)):
            raise SpecError(
                "cycles", f"expected a number of cycles or a list of steps, got {self.cycles!r}"
            )
        if isinstance(self.cycles, int):
            if self.cycles < 1:
                raise SpecError("cycles", f"expected at least 1 cycle, got {self.cycles}")
            return
        ends = list(self.cycles)
        if not ends or any(not isinstance(e, int) or isinstance(e, bool) or e < 1 for e in ends) \
                or ends != sorted(set(ends)):  # fmt: skip
            raise SpecError("cycles", f"the steps where cycles end must increase from 1, got {ends}")

    def cooldown_steps(self, num_train_steps: int) -> int:
        return 0 if self.cooldown is None else _steps(self.cooldown, num_train_steps)

    def cycle_points(self, main_steps: int) -> list[int]:
        """Where each cycle starts, then where the last ends: [0, ..., main_steps] (Levanter's
        `_get_cycle_minima`)."""
        if isinstance(self.cycles, int):
            points = [int(main_steps / self.cycles * (i + 1)) for i in range(self.cycles - 1)]
        else:
            points = list(self.cycles or ())
        points.insert(0, 0)
        if points[-1] != main_steps:
            points.append(main_steps)
        return points

    def schedule_steps(self, num_train_steps: int) -> tuple[int, int]:
        """(warmup steps, decay steps) of a run of `num_train_steps`; between them the learning
        rate holds at its peak. Both phases must fit in the run."""
        self._check_cycles_fit(num_train_steps)
        warmup = _steps(self.warmup, num_train_steps)
        if warmup > num_train_steps:
            raise SpecError(
                "warmup",
                f"{self.warmup} is {warmup} steps, more than num_train_steps ({num_train_steps})",
            )
        if self.decay is None:
            return warmup, num_train_steps - warmup
        decay = _steps(self.decay, num_train_steps)
        if warmup + decay > num_train_steps:
            raise SpecError(
                "decay",
                f"warmup + decay = {warmup} + {decay} steps exceeds num_train_steps "
                f"({num_train_steps})",
            )
        return warmup, decay

    def _check_cycles_fit(self, num_train_steps: int) -> None:
        cooldown = self.cooldown_steps(num_train_steps)
        if cooldown > num_train_steps:
            raise SpecError(
                "cooldown", f"{self.cooldown} is {cooldown} steps, more than num_train_steps "
                f"({num_train_steps})",
            )  # fmt: skip
        if isinstance(self.cycles, tuple) and self.cycles[-1] > num_train_steps - cooldown:
            raise SpecError(
                "cycles", f"the last cycle ends at step {self.cycles[-1]}, after the "
                f"{num_train_steps - cooldown} steps before the cooldown",
            )  # fmt: skip

    @classmethod
    def from_json(cls, obj: Any, where: str = "optimizer") -> AdamConfig:
        return read_json(cls, obj, where)

    def to_json(self) -> dict[str, Any]:
        """Every field, but the cycle fields only when set: configs without them keep their
        fingerprints."""
        values = scalar_json(self)
        for name, unset in _CYCLE_DEFAULTS.items():
            if values[name] == unset:
                del values[name]
        return values


_CYCLE_DEFAULTS = {"rewarmup": 0.0, "cycles": None, "cooldown": None}


def _steps(amount: float, num_train_steps: int) -> int:
    """`warmup` and `decay` up to 1 are fractions of the run (1: all of it), above 1 whole steps:
    Levanter's `_convert_frac_or_steps`."""
    return int(amount * num_train_steps) if amount <= 1 else int(amount)
