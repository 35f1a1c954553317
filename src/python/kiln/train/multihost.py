"""Agreement between the processes of a multi-host run (one jax runtime over several hosts).

Every process runs the same program, and every collective (a train step, an orbax save) must be
entered by all of them. Decisions that read per-process state (a clock, a signal, a control
request, the file system) are therefore agreed on before they start a collective. With one
process these are no-ops.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.experimental import multihost_utils


def barrier(name: str) -> None:
    """Returns once every process has reached the barrier `name`."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def agree_max(values: list[int]) -> list[int]:
    """Element-wise maximum over all processes of each process's `values` (flags: any process)."""
    if jax.process_count() == 1:
        return list(values)
    gathered = multihost_utils.process_allgather(np.asarray(values, np.int64))
    return [int(v) for v in np.asarray(gathered).reshape(-1, len(values)).max(axis=0)]
