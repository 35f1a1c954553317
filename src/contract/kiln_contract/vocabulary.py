"""The words both halves use: choices a BUILD file or a spec may name, and the version rules."""

from __future__ import annotations

import datetime
import re
from collections.abc import Mapping
from typing import Any

from kiln_contract.parsing import SpecError, check_choice, field_path

# How attention is computed: `auto` is pallas on GPU, xla elsewhere (kiln.model.attention).
ATTENTION_IMPLS = ("auto", "xla", "pallas", "cudnn")
# What each transformer block keeps for the backward pass (gradient checkpointing).
REMAT_POLICIES = ("none", "full", "save_dots", "offload")
# The device mesh's axes, outermost first: batch, parameters + batch (FSDP), heads and MLP.
MESH_AXES = ("data", "fsdp", "tensor")
RESOURCE_KINDS = ("cpu", "gpu", "tpu")
# Dtypes the trainer computes and stores parameters in; BUILD files offer the first two, the
# ones whose training numerics Kiln tests (float16 would need loss scaling).
DTYPES = ("bfloat16", "float32", "float16")
COMPUTE_DTYPES = DTYPES[:2]
WANDB_MODES = ("online", "offline", "disabled")
PROGRESS_MODES = ("auto", "bar", "log", "none")
# The Python standard library's own prose, a source needing no download (kiln.data.stdlib_corpus).
STDLIB_PARTS = ("docstrings", "pydoc_topics", "all")
STDLIB_SPLITS = ("train", "validation")

_CALENDAR_VERSION = re.compile(r"^(\d{4})\.(\d{2})\.(\d{2})(\.\d+)?$")


def is_mutable_version(version: str) -> bool:
    """`dev` and `NAME-dev` versions are rebuilt every time and never drift-checked."""
    return version == "dev" or version.endswith("-dev")


def is_calendar_version(version: str) -> bool:
    """`YYYY.MM.DD` or `YYYY.MM.DD.N`, with a real date."""
    match = _CALENDAR_VERSION.match(version)
    if not match:
        return False
    try:
        datetime.date(*(int(part) for part in match.groups()[:3]))
    except ValueError:
        return False
    return True


def mesh_sizes(value: Any, where: str = "mesh") -> dict[str, int]:
    """The size of every mesh axis: missing axes are 1, and one axis may be -1 (all remaining
    devices)."""
    if not isinstance(value, Mapping):
        raise SpecError(where, f"expected a JSON object of mesh axis -> size, got {value!r}")
    for axis in value:
        check_choice(where, axis, MESH_AXES)
    sizes = {axis: value.get(axis, 1) for axis in MESH_AXES}
    for axis, size in sizes.items():
        if isinstance(size, bool) or not isinstance(size, int) or (size < 1 and size != -1):
            raise SpecError(
                field_path(where, axis), f"expected a positive integer or -1, got {size!r}"
            )
    if list(sizes.values()).count(-1) > 1:
        raise SpecError(where, "at most one axis may be -1 (the rest of the devices)")
    return sizes
