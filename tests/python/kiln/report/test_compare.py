"""`python -m kiln.report compare`: a row per run with the fields the runs differ in, runs not
built listed as such, a CSV of the table, and a plot with a power law fitted to the compute
frontier. The folders here are written in the store's layout; tests/e2e/test_sweeps.py compares
runs that `pants build` trained."""

from __future__ import annotations

import csv
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from kiln_testing.bucket_fixtures import s3_server  # noqa: F401 - a fixture
from kiln_testing.buckets import fresh_url

from kiln.artifacts.content import copy_folder_into
from kiln.artifacts.locations import open_store
from kiln.report.compare import (
    FamilyStart,
    columns_note,
    family_start,
    format_table,
    read_run,
    started_from_each_other,
    table,
    varied_fields,
)
from kiln.report.compare_plot import fit_power_law, frontier, plot_comparison
from kiln_contract.llama import LlamaArchitecture, flops_per_token

VOCAB = 8192


def identity(hidden_dim: int, learning_rate: float, steps: int = 100) -> dict:
    model = LlamaArchitecture(128, hidden_dim, 4 * hidden_dim, 4, 2, 2).to_json()
    return {
        "kind": "lm_checkpoint", "format": 1, "model": model,
        "optimizer": {"learning_rate": learning_rate, "weight_decay": 0.1},
        "datasets": [{"input": "tokenized/a@2026.11.29", "fingerprint": "f" * 16, "weight": 1.0}],
        "batch_size": 16, "seq_len": 128, "num_train_steps": steps,
    }  # fmt: skip


def write_run(store: Path, name: str, ident: dict, loss: float | None, status: str = "SUCCESS") -> Path:
    folder = store / "checkpoints" / name / "2026.12.02"
    folder.mkdir(parents=True)
    record = {"name": f"checkpoints/{name}", "version": "2026.12.02", "identity": ident}
    (folder / "artifact.json").write_text(json.dumps(record))
    (folder / "STATUS").write_text(f"{status}\n")
    if loss is not None:
        summary = {"train/loss": loss + 0.1, "eval/val/loss": loss, "eval/val/bpb": loss / 3,
                   "lm_eval/mc/acc": 0.25, "wall_time_seconds": 75.0}  # fmt: skip
        (folder / "summary.json").write_text(json.dumps(summary))
        (folder / "config.json").write_text(json.dumps({"model": {**ident["model"], "vocab_size": VOCAB}}))
        lines = [{"step": s, "train/loss": loss + 2.0 / s} for s in range(1, 11)]
        lines += [{"step": s, "eval/val/loss": loss + 1.0 / s} for s in (5, 10)]
        (folder / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return folder


def write_evaluation(store: Path, loss: float) -> Path:
    """An lm_eval_run's folder: its record and scores."""
    folder = store / "evals/s-d256-eval/2026.12.02"
    folder.mkdir(parents=True)
    record = {"kind": "lm_eval_run", "name": "evals/s-d256-eval", "version": "2026.12.02",
              "identity": {"kind": "lm_eval_run", "model": {"kind": "lm_checkpoint"}}}  # fmt: skip
    (folder / "artifact.json").write_text(json.dumps(record))
    results = {"model": "checkpoints/s-d256@2026.12.02", "metrics": {"eval/val/loss": loss}}
    (folder / "results.json").write_text(json.dumps(results))
    (folder / "STATUS").write_text("SUCCESS\n")
    return folder


def test_a_row_per_run_with_the_fields_that_vary(tmp_path: Path) -> None:
    a = write_run(tmp_path, "s-d64-lr1e-3", identity(64, 1e-3), 5.0)
    b = write_run(tmp_path, "s-d64-lr3e-3", identity(64, 3e-3), 4.5)
    c = write_run(tmp_path, "s-d128-lr1e-3", identity(128, 1e-3), None, status="RUNNING")
    rows = [read_run(str(folder)) for folder in (a, b, c)] + [
        read_run(str(tmp_path / "nowhere"), "checkpoints/s-d128-lr3e-3@2026.12.02", identity(128, 3e-3))
    ]
    assert varied_fields(rows) == [
        "model.hidden_dim", "model.intermediate_dim", "optimizer.learning_rate"
    ]  # fmt: skip
    header, cells = table(rows)
    assert header == [
        "run", "model.hidden_dim", "model.intermediate_dim", "optimizer.learning_rate", "state",
        "train/loss", "eval/val/bpb", "eval/val/loss", "lm_eval/mc/acc", "tokens", "FLOPs",
        "wall time",
    ]  # fmt: skip
    flops = 16 * 128 * 100 * flops_per_token(LlamaArchitecture(128, 64, 256, 4, 2, 2), VOCAB, 128)
    assert cells[1] == ["checkpoints/s-d64-lr3e-3@2026.12.02", "64", "256", "0.003", "built",
                        "4.6", "1.5", "4.5", "0.25", "204800", f"{flops:.4g}".replace("e+", "e"),
                        "0:01:15"]  # fmt: skip
    assert cells[2][:5] == ["checkpoints/s-d128-lr1e-3@2026.12.02", "128", "512", "0.001", "RUNNING"]
    assert cells[3][4:6] == ["not built", ""]  # listed, its numbers blank


def test_the_power_law_is_recovered_from_its_frontier() -> None:
    compute = np.geomspace(1e12, 1e16, 5)
    law = 40.0 * compute ** -0.1 + 1.5
    # A learning-rate sweep at each size: the worse runs sit above the frontier.
    points = [*zip(compute, law), *zip(compute, law + 0.4)]
    best = frontier(points)
    fitted = fit_power_law([c for c, _ in best], [loss for _, loss in best])
    assert fitted is not None
    assert fitted.b == pytest.approx(0.1, rel=0.05) and fitted.c == pytest.approx(1.5, abs=0.05)
    assert fit_power_law([1e12, 1e13], [3.0, 2.0]) is None  # two points: no law


def test_the_command_writes_the_table_csv_and_plot(tmp_path: Path) -> None:
    folders = [
        write_run(tmp_path, f"s-d{d}", identity(d, 1e-3), loss)
        for d, loss in ((32, 6.0), (64, 5.2), (128, 4.7), (256, 4.5))
    ]
    runs = tmp_path / "runs.json"
    runs.write_text(json.dumps([{"name": "checkpoints/s-d512@2026.12.02",
                                 "folder": str(tmp_path / "none"), "identity": identity(512, 1e-3)}]))  # fmt: skip
    evaluation = write_evaluation(tmp_path, 4.4)
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "-m", "kiln.report", "compare", *map(str, folders), str(evaluation),
         "--runs", str(runs), "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "eval/val/loss against training FLOPs; fitted to the frontier: L(C) = " in result.stdout
    assert "1 of 6 run(s) not built: checkpoints/s-d512@2026.12.02 (not built)" in result.stdout
    # The curves of the four runs with metrics; the evaluation and the unbuilt run have none.
    assert "curves.png: train loss and eval/val/loss of 4 run(s) against step" in result.stdout
    with open(out / "compare.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["run"] for r in rows][-1] == "evals/s-d256-eval@2026.12.02"
    assert [r["eval/val/loss"] for r in rows] == ["6", "5.2", "4.7", "4.5", "", "4.4"]
    for name in ("compare.png", "curves.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_wide_table_prints_in_100_columns_with_its_runs_numbered() -> None:
    header = ["run", "state", "train/loss", "eval/stdlib_validation/loss",
              "eval/stdlib_validation/bpb", "lm_eval/kiln_stdlib_mc/acc", "tokens", "FLOPs"]  # fmt: skip
    cells = [
        ["checkpoints/lifecycle/base@2026.12.02", "built", "5.1", "5.3", "1.9", "", "10240",
         "4.1e11"],
        ["evals/lifecycle/base@2026.12.02 (of checkpoints/lifecycle/base@2026.12.02 step 40)",
         "built", "", "5.3", "1.9", "0.25", "", ""],
    ]  # fmt: skip
    printed = format_table(header, cells)
    lines = printed.splitlines()
    assert max(map(len, lines)) <= 100, printed
    assert lines[2].split(maxsplit=1) == ["1", cells[0][0]]  # the legend: number, full name
    assert lines[3].split(maxsplit=1) == ["2", cells[1][0]]
    block_headers = [line.split() for line in lines if line.startswith("#  ")][1:]
    assert [name for block in block_headers for name in block[1:]] == header[1:]  # each once
    assert len(block_headers) > 1 and all(block[0] == "#" for block in block_headers)
    assert [line.split()[:2] for line in lines if line.startswith(("1 ", "2 "))][2:4] == [
        ["1", "built"], ["2", "built"]
    ]  # the first block's rows, by number
    long = format_table([*header, "stages"], [[*row, "x" * 150] for row in cells])
    assert max(map(len, long.splitlines())) <= 100 and "x" * 96 + "\u2026" in long  # cut
    narrow = [["run", "loss"], [["a@1", "5.1"], ["b@1", "4.9"]]]
    assert format_table(*narrow) == "run  loss\n---  ----\na@1  5.1\nb@1  4.9\n"  # as it is


@pytest.mark.usefixtures("s3_server")
def test_a_run_in_a_bucket_reads_as_the_same_run_in_a_folder(tmp_path: Path) -> None:
    folder = write_run(tmp_path, "s-d64-lr1e-3", identity(64, 1e-3), 5.0)
    url = fresh_url("s3")
    copy_folder_into(open_store(url), "", folder)
    here, there = read_run(str(folder)), read_run(url)
    assert there.folder == url and there.built
    assert (there.name, there.identity, there.summary, there.flops) == (
        here.name, here.identity, here.summary, here.flops
    )  # fmt: skip


def test_a_family_is_drawn_and_counted_from_where_each_run_left_its_parent(tmp_path: Path) -> None:
    """A cooldown from the base's final step 40 (4 x 64 tokens a step) starts at step 40 and
    10,240 tokens, and counts the base's FLOPs of them; its child from its step 10 (8 x 64) at
    step 50 and 15,360. An evaluation's row names the model and step it scores."""
    model = LlamaArchitecture(128, 32, 64, 2, 1, 1)

    def built(name: str, steps: int, batch: int, parent: dict | None) -> str:
        identity = {"num_train_steps": steps, "batch_size": batch, "seq_len": 64,
                    "model": model.to_json(), "init_from": parent}  # fmt: skip
        folder = tmp_path / name / "v1"
        folder.mkdir(parents=True)
        (folder / "artifact.json").write_text(json.dumps(
            {"name": name, "version": "v1", "identity": identity}))  # fmt: skip
        (folder / "config.json").write_text(json.dumps({"model": {"vocab_size": VOCAB}}))
        (folder / "STATUS").write_text("SUCCESS\n")
        return str(folder)

    def parent(name: str, step: int | None) -> dict:
        return {"kind": "lm_checkpoint", "name": name, "version": "v1", "step": step}

    per_token = flops_per_token(model, VOCAB, 64)
    base = read_run(built("c/base", 40, 4, None))
    cooldown = read_run(built("c/cool", 20, 8, parent("c/base", None)))
    child = read_run(built("c/child", 5, 8, parent("c/cool", 10)))
    assert (base.start.step, base.start.tokens, base.flops) == (0, 0, 40 * 256 * per_token)
    assert (cooldown.start.step, cooldown.start.tokens) == (40, 40 * 256)
    assert cooldown.flops == pytest.approx((40 * 256 + 20 * 512) * per_token)
    assert (child.start.step, child.start.tokens) == (50, 40 * 256 + 10 * 512)
    # A family: no scaling law through a parent and its children, and the columns say what
    # they count; a sweep (no run from another of its runs) has no note.
    family = [dataclasses.replace(r, summary={"eval/val/loss": loss})
              for r, loss in ((base, 3.0), (cooldown, 2.5), (child, 2.4))]  # fmt: skip
    assert started_from_each_other(family) and not started_from_each_other([base, child])
    assert "tokens: each run's own training tokens; FLOPs: its own and its parents'" in (
        columns_note(family) or "")  # fmt: skip
    assert columns_note([base]) is None
    shown = plot_comparison(family, "eval/val/loss", tmp_path)
    assert shown.endswith("no power law: the runs started from each other (a family, not a sweep)")
    hf = {**child.identity, "init_from": {"kind": "hf_model", "name": "hf/x", "version": "v1"}}
    assert family_start(child.folder, child.name, hf) == FamilyStart()
    missing = {**child.identity, "init_from": parent("c/gone", None)}
    assert family_start(child.folder, child.name, missing) == FamilyStart()

    scores = tmp_path / "e/base/v1"
    scores.mkdir(parents=True)
    (scores / "artifact.json").write_text(json.dumps({
        "kind": "lm_eval_run", "name": "e/base", "version": "v1",
        "identity": {"kind": "lm_eval_run", "model": parent("c/base", 40)}}))  # fmt: skip
    (scores / "STATUS").write_text("SUCCESS\n")
    (scores / "results.json").write_text(json.dumps({"metrics": {}}))
    _, cells = table([base, read_run(str(scores))])
    assert cells[1][0] == "e/base@v1 (of c/base@v1 step 40)"
    # Of the run's last step: the one its summary reports when the run is in the table.
    (scores / "artifact.json").write_text(json.dumps({
        "kind": "lm_eval_run", "name": "e/base", "version": "v1",
        "identity": {"kind": "lm_eval_run", "model": parent("c/base", None)}}))  # fmt: skip
    assert table([base, read_run(str(scores))])[1][1][0] == "e/base@v1 (of c/base@v1 step 40)"
    assert table([read_run(str(scores))])[1][0][0] == "e/base@v1 (of c/base@v1 step last)"
