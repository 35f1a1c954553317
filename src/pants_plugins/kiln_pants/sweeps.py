"""`lm_sweep(...)`: a BUILD macro that expands a grid of runs into ordinary `lm_checkpoint`
targets, plus one `target` that depends on them all (the sweep's address).

```
lm_sweep(
    name="lr_sweep",
    version="2026.12.02",
    base=dict(model=llama(...), optimizer=adam(...), datasets={...}, ...),  # lm_checkpoint's fields
    grid={"model": {"d64": llama(...), "d128": llama(...)}, "learning_rate": [1e-3, 3e-3]},
)
```

makes `lr_sweep-d64-lr1e-3`, `lr_sweep-d64-lr3e-3`, ... : each `base` with one point of the grid
applied. A grid key is an `lm_checkpoint` field (`num_train_steps`, `model`, ...) or a field of
the base's `llama(...)` (`hidden_dim`) or `adam(...)` (`learning_rate`); `zip={...}` lists vary
together instead of crossing (bigger models, more steps). The runs are targets like any other:
their fingerprints are those of the same `lm_checkpoint` written by hand. A grid that names an
unknown field or repeats a point fails while the BUILD file loads (`pants list`), naming the
sweep and the value.

It is a Pants "context-aware object factory" (a BUILD macro registered by the backend), not a
target generator: the runs get plain names (`:lr_sweep-d64-lr3e-3`, not `:lr_sweep#...`) and
nothing new is scheduled: `pants build`, `plan` and `compare` see N checkpoints.
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

from kiln_contract.adam import AdamConfig
from kiln_contract.llama import LlamaArchitecture
from kiln_contract.parsing import SpecError
from kiln_pants.target_types import LmCheckpointTarget, ModelField, OptimizerField

# Short labels of the usual grid keys in run names; other keys are written out.
LABELS = {
    "learning_rate": "lr", "weight_decay": "wd", "warmup": "warmup", "num_train_steps": "steps",
    "batch_size": "bs", "seq_len": "seq", "seed": "seed", "hidden_dim": "d", "num_layers": "l",
    "num_heads": "h", "num_kv_heads": "kv", "intermediate_dim": "ff", "z_loss_weight": "z",
    "min_lr_ratio": "minlr", "beta2": "b2",
}  # fmt: skip
# The sweep's own fields, and those that a run's name and grouping decide.
NOT_IN_BASE = ("name", "version")
MODEL_FIELDS = tuple(f.name for f in dataclasses.fields(LlamaArchitecture))
OPTIMIZER_FIELDS = tuple(f.name for f in dataclasses.fields(AdamConfig))


class SweepError(ValueError):
    pass


@dataclass(frozen=True)
class SweepRun:
    name: str  # the target name: {sweep}-{label}-{label}...
    fields: dict[str, Any]  # the lm_checkpoint's fields
    point: dict[str, Any]  # grid key -> this run's value


def checkpoint_fields() -> tuple[str, ...]:
    return tuple(field.alias for field in LmCheckpointTarget.core_fields)


def expand_sweep(
    name: str,
    base: Mapping[str, Any],
    grid: Optional[Mapping[str, Any]] = None,
    zipped: Optional[Mapping[str, Any]] = None,
) -> list[SweepRun]:
    """The runs of a sweep: every point of `zipped` (lists of one length, taken together)
    crossed with every combination of `grid`, each applied to `base`."""
    where = f"lm_sweep {name!r}"
    _check_base(where, base)
    axes = _axes(where, grid or {}, zipped or {})
    if not axes:
        raise SweepError(f"{where}: give a `grid` or `zip` of at least one field to vary.")
    runs: list[SweepRun] = []
    names: dict[str, dict[str, Any]] = {}
    points: dict[str, dict[str, Any]] = {}
    for choices in _points(where, grid or {}, zipped or {}, axes):
        point = {key: value for key, (_, value) in choices.items()}
        run_name = "-".join([name, *(label for label, _ in choices.values())])
        same = points.get(repr(point)) or names.get(run_name)
        if same == point:
            raise SweepError(f"{where}: the point {_describe(point)} is listed twice.")
        if same is not None:
            raise SweepError(
                f"{where}: the points {_describe(same)} and {_describe(point)} would both be "
                f"named {run_name!r}; give that field's values as a dict of names."
            )
        names[run_name] = points[repr(point)] = point
        runs.append(SweepRun(run_name, _apply(where, base, point), point))
    return runs


def _check_base(where: str, base: Mapping[str, Any]) -> None:
    if not isinstance(base, Mapping):
        raise SweepError(f"{where}: `base` must be a dict of lm_checkpoint fields, got {base!r}.")
    known = checkpoint_fields()
    for key in base:
        if key in NOT_IN_BASE:
            raise SweepError(
                f"{where}: `base` gives {key!r}; the sweep sets each run's {key} itself "
                "(give `version=` to lm_sweep)."
            )
        if key not in known:
            raise SweepError(f"{where}: `base` names {key!r}, which is not an lm_checkpoint field.")


def _axes(where: str, grid: Mapping[str, Any], zipped: Mapping[str, Any]) -> list[str]:
    for what, values in (("grid", grid), ("zip", zipped)):
        if not isinstance(values, Mapping):
            raise SweepError(f"{where}: `{what}` must be a dict of field -> values.")
    both = set(grid) & set(zipped)
    if both:
        raise SweepError(f"{where}: {sorted(both)[0]!r} is in both `grid` and `zip`.")
    keys = [*zipped, *grid]
    for key in keys:
        _target_of(where, key)
    lengths = {key: len(_values(where, key, zipped[key])) for key in zipped}
    if len(set(lengths.values())) > 1:
        raise SweepError(
            f"{where}: the `zip` lists differ in length ({_describe(lengths)}); they vary "
            "together, one value of each per run."
        )
    return keys


def _target_of(where: str, key: str) -> str:
    """Which object a grid key changes: the checkpoint itself, its model or its optimizer."""
    if key in NOT_IN_BASE:
        raise SweepError(f"{where}: the grid varies {key!r}, which the sweep sets itself.")
    if key in checkpoint_fields():
        return "checkpoint"
    if key in MODEL_FIELDS:
        return "model"
    if key in OPTIMIZER_FIELDS:
        return "optimizer"
    raise SweepError(
        f"{where}: the grid names {key!r}, which is not a field of lm_checkpoint, llama(...) "
        "or adam(...)."
    )


def _values(where: str, key: str, values: Any) -> list[tuple[str, Any]]:
    """(label, value) pairs: a dict's own names, else a label made from each value."""
    if isinstance(values, Mapping):
        pairs = [(str(label), value) for label, value in values.items()]
    elif isinstance(values, (list, tuple)):
        pairs = [(_label(where, key, value, values), value) for value in values]
    else:
        raise SweepError(
            f"{where}: the values of {key!r} must be a list, or a dict from run-name labels to "
            f"values; got {values!r}."
        )
    if not pairs:
        raise SweepError(f"{where}: {key!r} has no values.")
    return pairs


def _points(
    where: str, grid: Mapping[str, Any], zipped: Mapping[str, Any], axes: list[str]
) -> list[dict[str, tuple[str, Any]]]:
    zipped_pairs = [_values(where, key, zipped[key]) for key in zipped]
    zipped_points = list(zip(*zipped_pairs)) if zipped_pairs else [()]
    grid_pairs = [_values(where, key, grid[key]) for key in grid]
    return [
        dict(zip(axes, (*zipped_choice, *grid_choice)))
        for zipped_choice in zipped_points
        for grid_choice in itertools.product(*grid_pairs)
    ]


def _label(where: str, key: str, value: Any, values: Any) -> str:
    if isinstance(value, bool) or value is None:
        return f"{LABELS.get(key, key)}{value}"
    if isinstance(value, (int, float)):
        return f"{LABELS.get(key, key)}{short_number(value)}"
    if isinstance(value, LlamaArchitecture):
        return _model_label(where, value, [v for v in values if isinstance(v, LlamaArchitecture)])
    raise SweepError(
        f"{where}: cannot name runs after {key!r} = {value!r}; give the values as a dict from "
        f"run-name labels to values, e.g. {{'a': ..., 'b': ...}}."
    )


def _model_label(where: str, model: LlamaArchitecture, models: list[LlamaArchitecture]) -> str:
    """A model named by the sizes in which the grid's models differ: `d256`, `d256-l4`."""
    differing = [f for f in MODEL_FIELDS if len({getattr(m, f) for m in models}) > 1]
    if not differing:
        raise SweepError(f"{where}: the grid lists the model {model!r} more than once.")
    return "".join(f"{LABELS.get(f, f)}{short_number(getattr(model, f))}" for f in differing)


def short_number(value: float) -> str:
    """A number as a run name writes it: 3e-3, 0.5, 400, 1e5."""
    if isinstance(value, int) or (float(value).is_integer() and abs(value) < 1e4):
        return str(int(value))
    if 0.1 <= abs(value) < 1e4:
        return repr(float(value))
    mantissa, exponent = f"{value:e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"


def _apply(where: str, base: Mapping[str, Any], point: Mapping[str, Any]) -> dict[str, Any]:
    fields = dict(base)
    for key, value in point.items():
        target = _target_of(where, key)
        if target == "checkpoint":
            fields[key] = value
            continue
        field = ModelField.alias if target == "model" else OptimizerField.alias
        helper = fields.get(field)
        if helper is None:
            raise SweepError(
                f"{where}: the grid varies {key!r} of `{field}`, and `base` gives no {field}."
            )
        try:
            fields[field] = dataclasses.replace(helper, **{key: value})
        except SpecError as e:
            raise SweepError(f"{where}: {key}={value!r}: {e.problem}.") from None
        except TypeError:
            raise SweepError(
                f"{where}: the grid varies {key!r} of `{field}`, which is not a "
                f"{'llama' if target == 'model' else 'adam'}(...) object."
            ) from None
    return fields


def _describe(point: Mapping[str, Any]) -> str:
    return ", ".join(f"{key}={value!r}" for key, value in point.items())


class LmSweepMacro:
    """`lm_sweep(name, version, base, grid=None, zip=None, tags=None, description=None)`: a grid
    of `lm_checkpoint`s named `{name}-{label}...` and a `target` `name` that depends on them."""

    def __init__(self, parse_context: Any) -> None:
        self._parse_context = parse_context

    def __call__(
        self,
        name: str,
        version: str,
        base: Mapping[str, Any],
        grid: Optional[Mapping[str, Any]] = None,
        zip: Optional[Mapping[str, Any]] = None,  # noqa: A002 - the BUILD-file keyword
        tags: Optional[list[str]] = None,
        description: Optional[str] = None,
    ) -> None:
        frame = inspect.currentframe()
        line = frame.f_back.f_lineno if frame and frame.f_back else None  # of `lm_sweep(`
        runs = expand_sweep(name, base, grid, zip)
        sweep_tags = [*(tags or ()), name]
        for run in runs:
            fields = dict(run.fields)
            fields["tags"] = [*fields.get("tags", ()), *sweep_tags]
            # The runs of a sweep share a W&B group unless the base names one.
            fields["wandb"] = {"group": name, **dict(fields.get("wandb") or {})}
            created = self._parse_context.create_object(
                LmCheckpointTarget.alias, name=run.name, version=version, **fields
            )
            _point_at_line(created, line)
        created = self._parse_context.create_object(
            "target",
            name=name,
            dependencies=[f":{run.name}" for run in runs],
            tags=sweep_tags,
            description=description or f"lm_sweep: {len(runs)} runs of {_axes_text(runs)}",
        )
        _point_at_line(created, line)


def _point_at_line(target_adaptor: Any, line: Optional[int]) -> None:
    """Pants records, as a target's origin, the line that called its factory: for a sweep's
    targets a line of Pants' own `create_object`. Errors about them name the BUILD file's
    `lm_sweep(` line instead."""
    if line is not None:
        path = target_adaptor.description_of_origin.rpartition(":")[0]
        target_adaptor.description_of_origin = f"{path}:{line}"


def _axes_text(runs: list[SweepRun]) -> str:
    return " x ".join(f"{key} ({len({repr(r.point[key]) for r in runs})})" for key in runs[0].point)
