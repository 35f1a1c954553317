"""`python -m kiln.report compare RUN_DIR...`: the runs of a sweep side by side.

One row per run: the identity fields in which the runs differ (the sweep's grid), final train
loss, each validation set's loss and bits-per-byte, eval scores, tokens, training FLOPs (a run
started from another counts its parents' FLOPs up to where it left them) and wall time, read
from each checkpoint's folder (artifact.json, summary.json, config.json). An
evaluation's folder (an `lm_eval_run`) is a row of its scores (results.json), beside the runs. A run not
built yet (no STATUS SUCCESS) keeps its row, marked with its state, its numbers blank. The table
is printed and written as CSV; kiln.report.compare_plot draws validation loss against FLOPs.
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from kiln.artifacts.folder import ArtifactFolder
from kiln.report.table import clock_duration
from kiln_contract.layout import (
    EVAL_RESULTS_FILE,
    RECORD_FILE,
    RUN_CONFIG_FILE,
    RUN_SUMMARY_FILE,
    SUCCESS,
)
from kiln_contract.llama import LlamaArchitecture, flops_per_token

CSV_FILE = "compare.csv"
EVAL_KIND = "lm_eval_run"  # an evaluation's record kind: a row of scores beside the runs
# Identity fields that name the inputs rather than choose the run; a differing fingerprint of
# an input shows as the input's own field.
_SKIPPED = ("kind", "format")


@dataclass(frozen=True)
class FamilyStart:
    """Where a run's step 0 lies in its family: the step, training tokens and FLOPs at which it
    left its parent, its parent's own start added; zeros for a run from random or published
    weights. FLOPs None: a parent's are not known (its vocabulary is not recorded)."""

    step: int = 0
    tokens: int = 0
    flops: float | None = 0.0


@dataclass(frozen=True)
class RunRow:
    name: str  # name@version
    folder: str  # a path or a bucket URL
    state: str  # built, or why not: not built, FAILED, RUNNING, ...
    identity: dict[str, Any]
    summary: dict[str, Any] = field(default_factory=dict)
    vocab_size: int | None = None
    start: FamilyStart = FamilyStart()

    @property
    def built(self) -> bool:
        return self.state == "built"

    @property
    def is_evaluation(self) -> bool:
        """An evaluation's row (its scores), not a run's: it varies no field of the runs'."""
        return self.identity.get("kind") == EVAL_KIND

    @property
    def tokens(self) -> int | None:
        identity = self.identity
        keys = ("batch_size", "seq_len", "num_train_steps")
        return math.prod(identity[k] for k in keys) if all(k in identity for k in keys) else None

    @property
    def flops(self) -> float | None:
        """The run's training FLOPs, its parents' up to where it left them included."""
        own = _training_flops(self.identity, self.vocab_size, self.tokens)
        return None if own is None or self.start.flops is None else own + self.start.flops

    def metric(self, key: str) -> float | None:
        value = self.summary.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
        return None


def read_run(location: str, name: str | None = None, identity: dict[str, Any] | None = None) -> RunRow:
    """A checkpoint's folder (a path, or a URL in a bucket) as a row. `name` and `identity`
    (the plugin's, for a run that has no folder yet) stand in for the folder's artifact.json
    when it is absent."""
    folder = ArtifactFolder.at(location)
    record = _json(folder, RECORD_FILE) or {}
    identity = record.get("identity") or identity or {}
    label = f"{record['name']}@{record['version']}" if "name" in record else name or location
    status = folder.status()
    if status != SUCCESS:
        return RunRow(label, location, status or "not built", identity)
    if record.get("kind") == EVAL_KIND:  # an evaluation: its scores, no training
        results = _json(folder, EVAL_RESULTS_FILE) or {}
        return RunRow(label, location, "built", identity, dict(results.get("metrics", {})))
    config = _json(folder, RUN_CONFIG_FILE) or {}
    vocab = (config.get("model") or {}).get("vocab_size")
    summary = _json(folder, RUN_SUMMARY_FILE) or {}
    return RunRow(label, location, "built", identity, summary, vocab,
                  family_start(location, label, identity))  # fmt: skip


def family_start(location: str, ref: str, identity: dict[str, Any]) -> FamilyStart:
    """Where the run `ref` (name@version, at `location`) starts in its family, from its parents'
    records beside it in the store (`{prefix}/{name}/{version}`); zeros when it starts no
    family or its parent is not there."""
    parent = identity.get("init_from") or {}
    suffix = "/" + ref.replace("@", "/")
    if parent.get("kind") != "lm_checkpoint" or not location.rstrip("/").endswith(suffix):
        return FamilyStart()
    parent_ref = f"{parent['name']}@{parent['version']}"
    where = location.rstrip("/")[: -len(suffix)] + "/" + parent_ref.replace("@", "/")
    folder = ArtifactFolder.at(where)
    parent_identity = (_json(folder, RECORD_FILE) or {}).get("identity") or {}
    if "num_train_steps" not in parent_identity:
        return FamilyStart()
    step = parent["step"] if parent.get("step") is not None else parent_identity["num_train_steps"]
    tokens = step * parent_identity["batch_size"] * parent_identity["seq_len"]
    vocab = ((_json(folder, RUN_CONFIG_FILE) or {}).get("model") or {}).get("vocab_size")
    flops = _training_flops(parent_identity, vocab, tokens)
    before = family_start(where, parent_ref, parent_identity)
    return FamilyStart(
        before.step + step,
        before.tokens + tokens,
        None if flops is None or before.flops is None else before.flops + flops,
    )


def _training_flops(identity: dict[str, Any], vocab: int | None, tokens: int | None) -> float | None:
    if vocab is None or tokens is None or "model" not in identity:
        return None
    model = LlamaArchitecture.from_json(identity["model"])
    return tokens * flops_per_token(model, vocab, identity["seq_len"])


def _json(folder: ArtifactFolder, name: str) -> dict[str, Any] | None:
    try:
        value = json.loads(folder.text(name) or "null")
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def flat(identity: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested identity fields as `model.hidden_dim`, `optimizer.learning_rate`, ...; lists of
    inputs as their `name@version` (and weights)."""
    out: dict[str, Any] = {}
    for key, value in identity.items():
        if not prefix and key in _SKIPPED:
            continue
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flat(value, f"{name}."))
        elif isinstance(value, list):
            out[name] = ", ".join(_input_text(item) for item in value)
        else:
            out[name] = value
    return out


def _input_text(item: Any) -> str:
    if isinstance(item, dict) and "input" in item:
        weight = f" x{item['weight']:g}" if "weight" in item else ""
        return f"{item['input']}{weight}"
    return json.dumps(item, sort_keys=True)


def varied_fields(rows: list[RunRow]) -> list[str]:
    """The identity fields whose values differ between the runs, in identity order."""
    flats = [flat(row.identity) for row in rows if not row.is_evaluation]
    keys = list(dict.fromkeys(k for f in flats for k in f))
    return [k for k in keys if len({json.dumps(f.get(k), sort_keys=True) for f in flats}) > 1]


def in_grid_order(rows: list[RunRow]) -> list[RunRow]:
    """The rows ordered by the fields they vary, numbers by value (d64 before d128)."""
    varied = varied_fields(rows)

    def key(row: RunRow) -> tuple[bool, list[tuple[int, float, str]]]:
        values = flat(row.identity)
        return row.is_evaluation, [_order(values.get(field)) for field in varied]

    return sorted(rows, key=key)  # evaluations after the runs


def _order(value: Any) -> tuple[int, float, str]:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return (0, float(value), "")
    return (1, 0.0, str(value))


def metric_keys(rows: list[RunRow]) -> list[str]:
    """Each validation set's loss and bpb, then eval scores: the summaries' keys, sorted."""
    keys = {k for row in rows for k in row.summary}
    validation = sorted(
        k for k in keys if k.startswith("eval/") and k.count("/") == 2
        and k.endswith(("/loss", "/bpb"))
    )  # fmt: skip
    return validation + sorted(k for k in keys if k.startswith("lm_eval/"))


def started_from_each_other(rows: list[RunRow]) -> bool:
    """Whether some run started from another of the rows (a family: a run, its cooldowns, their
    fine-tunings), rather than each from its own start (a sweep)."""
    names = {row.name for row in rows}
    return any(
        f"{parent.get('name')}@{parent.get('version')}" in names
        for row in rows
        if (parent := row.identity.get("init_from") or {}).get("kind") == "lm_checkpoint"
    )


def columns_note(rows: list[RunRow]) -> str | None:
    """What a family's tokens and FLOPs columns count, which differ there: None for a sweep."""
    if not started_from_each_other(rows):
        return None
    return ("tokens: each run's own training tokens; FLOPs: its own and its parents' up to where "
            "it left them")  # fmt: skip


def table(rows: list[RunRow]) -> tuple[list[str], list[list[str]]]:
    """The header and the cells of the comparison."""
    varied = varied_fields(rows)
    metrics = metric_keys(rows)
    header = ["run", *varied, "state", "train/loss", *metrics, "tokens", "FLOPs", "wall time"]
    last_steps = {  # what a run trained to: its summary's step, else its identity's end
        row.name: row.summary.get("step", row.identity.get("num_train_steps"))
        for row in rows if not row.is_evaluation
    }  # fmt: skip
    cells = []
    for row in rows:
        values = {} if row.is_evaluation else flat(row.identity)
        cells.append([
            _label(row, last_steps),
            *(_cell(values.get(key)) for key in varied),
            row.state,
            _cell(row.metric("train/loss")),
            *(_cell(row.metric(key)) for key in metrics),
            _cell(row.tokens),
            _cell(row.flops),
            _cell(row.metric("wall_time_seconds"), clock_duration),
        ])  # fmt: skip
    return header, cells


def _label(row: RunRow, last_steps: dict[str, Any]) -> str:
    """A run by its name; an evaluation by its name and the model and step it scores (a run's
    last step, when the run is in the table)."""
    model = row.identity.get("model") if row.is_evaluation else None
    if not isinstance(model, dict):
        return row.name
    if "name" in model:  # a run or an export of the graph
        ref = f"{model['name']}@{model['version']}"
        step = model.get("step")
        if step is None:
            step = last_steps.get(ref)
        if step is None:
            step = "last"
        return f"{row.name} (of {ref} step {step})"
    if "model" in model:  # published weights: a hub id or a folder
        return f"{row.name} (of {model['model']})"
    return row.name


def _cell(value: Any, number_format: Callable[[float], str] | None = None) -> str:
    if value is None:
        return ""
    if number_format is not None:
        return number_format(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int):
        return str(value)
    return f"{value:.4g}".replace("e+", "e")


TABLE_WIDTH = 100  # the printed table's columns; the CSV holds every column in full


def format_table(header: list[str], cells: list[list[str]], width: int = TABLE_WIDTH) -> str:
    """The table as it prints: as it is when it fits `width`; else its runs numbered in a
    legend (a run's full name, an evaluation's model and step), then its columns in blocks of
    at most `width`, each led by the runs' numbers (a longer value cut, with an ellipsis)."""
    plain = _aligned(header, cells)
    if max(len(line) for line in plain.splitlines()) <= width:
        return plain
    numbers = [str(i) for i in range(1, len(cells) + 1)]
    legend = _aligned(["#", header[0]], [[n, row[0]] for n, row in zip(numbers, cells)])
    room = width - max(map(len, ["#", *numbers])) - 2
    cells = [[row[0], *(_shortened(cell, room) for cell in row[1:])] for row in cells]
    blocks = [legend]
    for columns in _column_blocks(header, cells, room):
        block_header = ["#", *(header[c] for c in columns)]
        rows = [[n, *(row[c] for c in columns)] for n, row in zip(numbers, cells)]
        blocks.append(_aligned(block_header, rows))
    return "\n".join(blocks)


def _shortened(cell: str, room: int) -> str:
    """A cell cut to `room` characters, ending in an ellipsis when cut (the CSV has it whole)."""
    return cell if len(cell) <= room else cell[: room - 1] + "\u2026"


def _aligned(header: list[str], cells: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *cells]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in [header, *cells]]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]]) + "\n"


def _column_blocks(header: list[str], cells: list[list[str]], room: int) -> list[list[int]]:
    """The columns after the first in blocks of at most `room` characters (a column wider than
    that alone), in order."""
    blocks: list[list[int]] = [[]]
    used = 0
    for column in range(1, len(header)):
        needed = 2 + max(len(r[column]) for r in [header, *cells])
        if blocks[-1] and used + needed > room:
            blocks.append([])
            used = 0
        blocks[-1].append(column)
        used += needed
    return blocks


def csv_text(header: list[str], cells: Iterable[list[str]]) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(header)
    writer.writerows(cells)
    return out.getvalue()
