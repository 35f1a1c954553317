"""How a training run ends short of its last step, as exceptions with their process exit codes.

TrainingError: failed (bad input or data, a diverged loss); the artifact's STATUS becomes FAILED.
TrainingStopped: resumable from its last checkpoint (a signal, runtime.max_steps_this_run); STATUS
stays RUNNING. Each says in `line` what a user reads of it.
"""

from __future__ import annotations


class TrainingError(RuntimeError):
    """An expected failure: the message says what happened and what to do."""

    exit_code = 1

    @property
    def line(self) -> str:
        return f"kiln.train: error: {self}"


class TrainingDiverged(TrainingError):
    exit_code = 2


class TrainingStopped(RuntimeError):
    """A run that stopped before its last step, resumable from its last checkpoint. The message
    says where it stopped and how to go on."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code

    @property
    def line(self) -> str:
        return f"kiln.train: {self}"


class TrainingInterrupted(TrainingStopped):
    def __init__(self, message: str, signum: int):
        super().__init__(message, 128 + signum)


# runtime.max_steps_this_run reached: a checkpoint was saved.
EXIT_STOPPED_EARLY = 3
