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

    def __post_init__(self) -> None:
        check_number("learning_rate", self.learning_rate, positive=True)
        check_number("weight_decay", self.weight_decay, minimum=0)
        check_number("beta1", self.beta1, minimum=0, below=1)
        check_number("beta2", self.beta2, minimum=0, below=1)
        check_number("epsilon", self.epsilon, positive=True)
        check_optional(check_number, "max_grad_norm", self.max_grad_norm, positive=True)
        check_number("warmup", self.warmup, minimum=0)
        check_optional(check_number, "decay", self.decay, minimum=0)
        for name in ("warmup", "decay"):
            amount = getattr(self, name)
            if amount is not None and amount > 1 and amount % 1:
                raise SpecError(
                    name,
                    f"{amount} is neither a fraction of the run (<= 1) nor a whole number of steps",
                )
        check_number("min_lr_ratio", self.min_lr_ratio, minimum=0, maximum=1)
        check_choice("lr_schedule", self.lr_schedule, LR_SCHEDULES)

    def schedule_steps(self, num_train_steps: int) -> tuple[int, int]:
        """(warmup steps, decay steps) of a run of `num_train_steps`; between them the learning
        rate holds at its peak. Both phases must fit in the run."""
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

    @classmethod
    def from_json(cls, obj: Any, where: str = "optimizer") -> AdamConfig:
        return read_json(cls, obj, where)

    def to_json(self) -> dict[str, Any]:
        return scalar_json(self)


def _steps(amount: float, num_train_steps: int) -> int:
    """`warmup` and `decay` up to 1 are fractions of the run (1: all of it), above 1 whole steps:
    Levanter's `_convert_frac_or_steps`."""
    return int(amount * num_train_steps) if amount <= 1 else int(amount)
