"""Checking spec values: one error type naming the JSON field, and the checks every contract
dataclass runs in `__post_init__`, so a BUILD file and a JSON spec are held to the same rules.

A dataclass checks its own fields and names them relative to itself (`warmup: ...`); whoever
reads it from JSON prefixes where it was (`config.optimizer.warmup: ...`), through `build`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable, TypeVar

from kiln_contract.location import is_bucket_url, location_argument

T = TypeVar("T")


class SpecError(ValueError):
    """A value that does not fit the contract: `field` is its dotted JSON path."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}" if field else problem)
        self.field = field
        self.problem = problem

    def within(self, where: str) -> SpecError:
        """The same error, its field path prefixed by the object it was read from."""
        return SpecError(field_path(where, self.field), self.problem)


MAX_SHOWN_CHARS = 120  # a value echoed in an error: its repr up to this many characters


def shown(value: Any) -> str:
    """`value` as an error message echoes it: its repr, cut to MAX_SHOWN_CHARS (a 10 MB name is
    named by its start and its length)."""
    text = repr(value)
    if len(text) <= MAX_SHOWN_CHARS:
        return text
    return f"{text[:MAX_SHOWN_CHARS]}... ({len(text):,} characters)"


def field_path(where: str, key: str) -> str:
    """`config` + `seed` -> `config.seed`; `config.datasets` + `[0]` -> `config.datasets[0]`."""
    if not where or not key:
        return where or key
    return f"{where}{key}" if key.startswith("[") else f"{where}.{key}"


# --- values ------------------------------------------------------------------------------------


def check_int(field: str, value: Any, *, minimum: int | None = None) -> None:
    expected = "an integer" + ("" if minimum is None else f" >= {minimum}")
    # bool is an int in Python; a `true` where a count belongs is a typo, not a 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(field, f"expected {expected}, got {shown(value)}")
    if minimum is not None and value < minimum:
        raise SpecError(field, f"expected {expected}, got {value}")


def check_number(
    field: str,
    value: Any,
    *,
    positive: bool = False,
    minimum: float | None = None,
    maximum: float | None = None,
    below: float | None = None,
) -> None:
    bounds = [
        "> 0" if positive else "",
        "" if minimum is None else f">= {minimum:g}",
        "" if maximum is None else f"<= {maximum:g}",
        "" if below is None else f"< {below:g}",
    ]
    expected = " ".join(["a number", " and ".join(b for b in bounds if b)]).strip()
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise SpecError(field, f"expected {expected}, got {shown(value)}")
    if (
        (positive and value <= 0)
        or (minimum is not None and value < minimum)
        or (maximum is not None and value > maximum)
        or (below is not None and value >= below)
    ):
        raise SpecError(field, f"expected {expected}, got {value}")


def check_str(field: str, value: Any) -> None:
    if not isinstance(value, str) or not value:
        raise SpecError(field, f"expected a non-empty string, got {shown(value)}")


def check_bool(field: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise SpecError(field, f"expected true or false, got {shown(value)}")


def check_choice(field: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise SpecError(field, f"expected one of {', '.join(choices)}, got {shown(value)}")


def check_absolute_path(field: str, value: Any) -> None:
    if not isinstance(value, Path) or not value.is_absolute():
        raise SpecError(field, f"expected an absolute path, got {str(value)!r}")


def check_location(field: str, value: Any) -> None:
    """Where an artifact is: an absolute path, or a bucket URL (a string)."""
    if not (is_bucket_url(value) or (isinstance(value, Path) and value.is_absolute())):
        raise SpecError(
            field,
            "expected an absolute path or a bucket URL (s3://BUCKET/PATH, gs://BUCKET/PATH), "
            f"got {str(value)!r}",
        )


def check_relative_path(field: str, value: Any) -> None:
    """A relative path that cannot climb out of the folder it is relative to."""
    check_str(field, value)
    if value.startswith("/") or any(part in ("", ".", "..") for part in value.split("/")):
        raise SpecError(
            field, f"expected a relative path without empty, `.` or `..` parts, got {shown(value)}"
        )


def check_optional(check: Callable[..., None], field: str, value: Any, **bounds: Any) -> None:
    """`check` unless the value is None (JSON null)."""
    if value is not None:
        check(field, value, **bounds)


def check_tuple_of(field: str, value: Any, kind: type) -> None:
    if not isinstance(value, tuple) or not all(isinstance(item, kind) for item in value):
        raise SpecError(field, f"expected a list of {kind.__name__}, got {shown(value)}")


# --- JSON -----------------------------------------------------------------------------------------


def json_keys(
    obj: Any, where: str, known: tuple[str, ...], required: tuple[str, ...]
) -> dict[str, Any]:
    """`obj` as a JSON object with no unknown keys (a typo is an error, never ignored) and
    every required one."""
    if not isinstance(obj, Mapping):
        raise SpecError(where, f"expected a JSON object, got {obj!r}")
    unknown = sorted(set(obj) - set(known))
    if unknown:
        raise SpecError(
            where, f"unknown field(s) {', '.join(map(str, unknown))} (known: {', '.join(known)})"
        )
    for key in required:
        if key not in obj:
            raise SpecError(field_path(where, key), "required field is missing")
    return dict(obj)


def json_fields(
    cls: type, obj: Any, where: str, header: Mapping[str, Any] | None = None, advice: str = ""
) -> dict[str, Any]:
    """`obj` as keyword arguments for the dataclass `cls`: its fields, those without a default
    required. `header` maps required keys that are not fields (a format version, a kind) to the
    one value each must have: checked (see check_header) and left out."""
    header = header or {}
    fields = [f for f in dataclasses.fields(cls) if f.init]
    required = [
        f.name
        for f in fields
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    known = (*header, *(f.name for f in fields))
    values = json_keys(obj, where, known, (*header, *required))
    check_header(where, values, header, advice)
    return values


def json_list(value: Any, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise SpecError(where, f"expected a JSON list, got {shown(value)}")
    return value


def json_path(value: Any) -> Any:
    """A JSON string as a Path (other values are left for the field's check to refuse)."""
    return Path(value) if isinstance(value, str) else value


def json_location(value: Any) -> Any:
    """A JSON string as a Path, unless it is a URL (kept a string: kiln_contract.location)."""
    return location_argument(value) if isinstance(value, str) else value


def build(cls: type[T], where: str, values: Mapping[str, Any]) -> T:
    """`cls(**values)`, its errors named from the JSON root."""
    try:
        return cls(**values)
    except SpecError as e:
        raise e.within(where) from None


def read_json(cls: type[T], obj: Any, where: str) -> T:
    """A dataclass whose fields are all JSON scalars, read from `obj`."""
    return build(cls, where, json_fields(cls, obj, where))


def scalar_json(value: Any, *, omit_none: bool = False) -> dict[str, Any]:
    """A dataclass of JSON scalars as a JSON object (Paths as strings); `omit_none`: without the
    fields that are None (optional ones a reader defaults)."""
    fields = ((f.name, getattr(value, f.name)) for f in dataclasses.fields(value) if f.init)
    return {name: _scalar(v) for name, v in fields if not (omit_none and v is None)}


def _scalar(value: Any) -> Any:
    return str(value) if isinstance(value, Path) else value


def check_header(
    where: str, values: dict[str, Any], header: Mapping[str, Any], advice: str
) -> None:
    """Pops each format key of `header` (`spec_version`, `kind`) from `values`: each must have
    its one value, else the error names the key and says `advice`."""
    for key, expected in header.items():
        value = values.pop(key)
        if value != expected:
            raise SpecError(field_path(where, key), f"expected {expected!r}, got {shown(value)}; {advice}")
