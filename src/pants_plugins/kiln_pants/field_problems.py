"""A Kiln target's bad field fails what reads that target, never the targets beside it.

Pants builds every target of a repository for some goals (Python dependency inference, which
`pants run` of any target needs), and a field that raises while its target is built fails those
goals for every target. So the fields of Kiln's targets hold their error as a value, a
FieldProblem, instead of raising it while the target is built; `check_target` raises it, and
the target's own cross-field checks (`check_fields`), where Kiln reads the target: the artifact
graph (`plan`, `build`, `run`, `compare`, `pants store`) and the inference of its inputs. The
error names the target, the field and what to do, as Pants' own would.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from pants.engine.addresses import Address
from pants.engine.target import (
    Field,
    InvalidFieldException,
    InvalidTargetException,
    SourcesField,
    Target,
)


@dataclass(frozen=True)
class FieldProblem:
    """A field's value where its BUILD file gave a bad one: the error, raised where Kiln reads
    the target."""

    message: str


def check_target(target: Target) -> None:
    """Raises what is wrong with a target, a field's problem or its cross-field checks', as Pants
    raises it for a target it cannot build: naming the BUILD file's line."""
    try:
        for field in target.field_values.values():
            if isinstance(field.value, FieldProblem):
                raise InvalidFieldException(field.value.message)
        check_fields: Callable[[], None] | None = getattr(target, "check_fields", None)
        if check_fields is not None:
            check_fields()
    except (InvalidFieldException, InvalidTargetException) as error:
        raise InvalidTargetException(
            str(error), description_of_origin=target.description_of_origin
        ) from None


TargetType = TypeVar("TargetType", bound=type[Target])


def holds_field_problems(target_type: TargetType) -> TargetType:
    """Class decorator: the target type's own fields (Kiln's, not Pants' nor sources fields)
    return a FieldProblem where they would raise."""
    for field_type in target_type.core_fields:
        own = field_type.__module__.startswith("kiln_pants.")
        if own and not issubclass(field_type, SourcesField) and field_type not in _HOLDING:
            _hold_problems(field_type)
    return target_type


_computing = threading.local()  # a field's compute_value is running on this thread


_HOLDING: set[type[Field]] = set()  # field types whose own compute_value is wrapped


def _hold_problems(field_type: type[Field]) -> None:
    compute = field_type.compute_value.__func__  # type: ignore[attr-defined]

    def compute_value(cls: type[Field], raw_value: Any, address: Address) -> Any:
        if getattr(_computing, "active", False):  # a subclass's compute_value calling super()
            return compute(cls, raw_value, address)
        _computing.active = True
        try:
            return compute(cls, raw_value, address)
        except InvalidFieldException as error:
            return FieldProblem(str(error))
        finally:
            _computing.active = False

    field_type.compute_value = classmethod(compute_value)  # type: ignore[method-assign,assignment]
    _HOLDING.add(field_type)
