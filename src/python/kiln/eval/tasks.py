"""Which lm-eval-harness tasks a run evaluates: the suite config of the step spec's
`config.evals`, defined by the contract (kiln_contract.evals) the Pants backend writes it with.

The reference CORE_TASKS list lives where experiments name it, in the BUILD-file symbols
(src/pants_plugins/kiln_pants/field_values.py); the runtime runs whatever suite the spec gives.
See docs/evals.md.
"""

from __future__ import annotations

from kiln_contract.evals import (
    DEFAULT_SEQUENCE_START,
    RESERVED_LABELS,
    SEQUENCE_STARTS,
    EvalSuiteConfig,
    EvalTask,
)

__all__ = [
    "DEFAULT_SEQUENCE_START",
    "RESERVED_LABELS",
    "SEQUENCE_STARTS",
    "EvalSuiteConfig",
    "EvalTask",
]
