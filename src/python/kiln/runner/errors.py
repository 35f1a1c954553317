"""The runner's expected failures: each is printed as one paragraph, with no traceback."""


class StepError(RuntimeError):
    """An expected failure: bad input, a damaged input cache, a lease held by another run."""


class LeaseLost(StepError):
    """This run's lease was taken over: another run owns the artifact now."""
