"""The words both halves use: choices a BUILD file or a spec may name, the rules for artifact
names and versions, and the bounds of values both halves check."""

from __future__ import annotations

import datetime
import re
from collections.abc import Mapping
from typing import Any

from kiln_contract.parsing import (
    SpecError,
    check_choice,
    check_int,
    check_number,
    check_str,
    field_path,
    shown,
)

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
# Which positions of a window the loss counts: `same_document`, those that predict a token of
# their own document (Kiln's default); `all`, every position but the window's last, as Levanter.
LOSS_POSITIONS = ("same_document", "all")
# The order a run reads its training windows in: `kiln` (the default), a fresh shuffle of each
# dataset per epoch; `levanter`, Levanter's block shuffle, the same every epoch
# (kiln.data.levanter_order).
DATA_ORDERS = ("kiln", "levanter")
LEVANTER_MIXTURE_BLOCK = 2048  # sequences in a block of Levanter's mixture (mixture_block_size)
WANDB_MODES = ("online", "offline", "disabled")
PROGRESS_MODES = ("auto", "bar", "log", "none")
# The W&B settings a BUILD file's `wandb={...}` may give (runtime.wandb's fields).
WANDB_SETTINGS = ("project", "entity", "group", "mode", "run_id")
# The Python standard library's own prose, a source needing no download (kiln.data.stdlib_corpus).
STDLIB_PARTS = ("docstrings", "pydoc_topics", "all")
STDLIB_SPLITS = ("train", "validation")
# A Hugging Face hub repository id: `org/name` (datasets and models alike).
HF_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# A hub revision: a commit hash, branch or tag, as the hub's URLs carry it.
_HF_REVISION = re.compile(r"^[\w][\w./-]{0,199}$")

_CALENDAR_VERSION = re.compile(r"^(\d{4})\.(\d{2})\.(\d{2})(\.\d+)?$")

# Names and versions become folders of the artifact store (`{prefix}/{name}/{version}`),
# TensorStore paths and W&B run ids. A conservative character set keeps each one inside its own
# folder and readable by every tool on the way: ASCII letters, digits, `_`, `.` and `-`, each part
# starting with a letter or digit (so no `.`, `..` or hidden parts), `/` only between the parts of
# a name. Spaces, `:`, `@`, `%`, `\`, non-ASCII and control characters are refused.
_PATH_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
MAX_NAME_CHARS = 200
MAX_VERSION_CHARS = 64
_PARTS_RULE = (
    "parts of ASCII letters, digits, `_`, `.` and `-`, each starting with a letter or digit"
)

# jax derives a run's PRNG key from 32 bits of the seed: larger seeds would repeat smaller ones.
MAX_SEED = 2**32 - 1
# A capability URL lives at most a week (docs/training-control.md); mint a fresh one after that.
MAX_TOKEN_TTL_MINUTES = 7 * 24 * 60


def check_artifact_name(field: str, value: Any) -> None:
    """An artifact name such as `checkpoints/dclm_1b_1x`: `/`-separated safe parts."""
    check_str(field, value)
    if len(value) > MAX_NAME_CHARS or not all(
        _PATH_PART.fullmatch(part) for part in value.split("/")
    ):
        raise SpecError(
            field,
            f"must be `/`-separated {_PARTS_RULE}, at most {MAX_NAME_CHARS} characters "
            f"(e.g. `checkpoints/my_run`); got {shown(value)}",
        )


def check_version(field: str, value: Any) -> None:
    """A calendar version or a mutable `dev` / `NAME-dev`, one safe path part."""
    check_str(field, value)
    if not (
        len(value) <= MAX_VERSION_CHARS
        and _PATH_PART.fullmatch(value)
        and (is_mutable_version(value) or is_calendar_version(value))
    ):
        raise SpecError(
            field,
            "must be a calendar version like 2026.06.28 (or 2026.06.28.1), or `dev` / "
            f"`NAME-dev` with NAME made of {_PARTS_RULE}, at most {MAX_VERSION_CHARS} "
            f"characters; got {shown(value)}",
        )


def check_address(artifact: Any) -> None:
    """An artifact's `name`, `version` and `fingerprint`: where it lives and what it is."""
    check_artifact_name("name", artifact.name)
    check_version("version", artifact.version)
    check_str("fingerprint", artifact.fingerprint)


def check_seed(field: str, value: Any) -> None:
    check_int(field, value, minimum=0)
    if value > MAX_SEED:
        raise SpecError(field, f"expected an integer from 0 to 2**32 - 1, got {value}")


def check_token_ttl(field: str, value: Any) -> None:
    """How long a control URL lives, in minutes: positive and at most a week."""
    check_number(field, value, positive=True, maximum=MAX_TOKEN_TTL_MINUTES)


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
        raise SpecError(where, f"expected a JSON object of mesh axis -> size, got {shown(value)}")
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


def check_eval_name(field: str, value: Any) -> None:
    """A validation set's name in metrics, e.g. `paloma/c4_en`: its metrics are
    `eval/paloma/c4_en/loss`, and each `/`-prefix (`paloma`) is a group with averages."""
    check_str(field, value)
    if len(value) > MAX_NAME_CHARS or not all(_PATH_PART.fullmatch(p) for p in value.split("/")):
        raise SpecError(
            field, f"expected a name of `/`-separated {_PARTS_RULE} (e.g. `paloma/c4_en`), "
            f"got {shown(value)}"
        )  # fmt: skip


def eval_groups(name: str) -> tuple[str, ...]:
    """The groups a validation set belongs to: `a/b/c` -> `a`, `a/b` (Levanter's tag hierarchy)."""
    parts = name.split("/")
    return tuple("/".join(parts[:i]) for i in range(1, len(parts)))


def check_eval_names(field: str, names: list[str]) -> None:
    """Validation sets' names must be unique, and none may be another's group: set `paloma`'s
    `eval/paloma/bpb` would be group `paloma`'s byte-weighted bpb too."""
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise SpecError(field, f"validation set name(s) used twice: {', '.join(twice)}")
    groups = {g for n in names for g in eval_groups(n)}
    clash = sorted(groups & set(names))
    if clash:
        raise SpecError(
            field, f"{', '.join(clash)} name(s) a validation set and a group of others; rename one"
        )


def check_hf_revision(field: str, value: Any) -> None:
    check_str(field, value)
    if not _HF_REVISION.match(value) or ".." in value:
        raise SpecError(
            field, f"{shown(value)} is not a hub revision (a commit hash, branch or tag)"
        )
