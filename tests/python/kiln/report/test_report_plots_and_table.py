"""The training plot and the end-of-run table, from metrics files generated here."""

from __future__ import annotations

import json
import math
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
from kiln_testing.processes import python_env

from kiln.report.metrics_log import MetricsError, read_metrics
from kiln.report.plots import eval_loss_keys, write_training_plot
from kiln.report.table import format_report

STEPS = 60
EVAL_EVERY = 20


def _train_loss(step: int) -> float:
    return 2.0 + 4.0 * math.exp(-step / 15)


def _write_run(run_dir: Path) -> None:
    lines = []
    for step in range(1, STEPS + 1):
        lines.append(
            {
                "step": step,
                "train/loss": _train_loss(step),
                "optim/learning_rate": 1e-3 * min(1.0, step / 10),
                "throughput/tokens_per_second": 900.0 if step == 1 else 4000.0 + step,
            }
        )
        if step % EVAL_EVERY == 0:
            lines.append(
                {
                    "step": step,
                    "eval/tokenized/stdlib/loss": 3.5 - step / 100,
                    "eval/tokenized/stdlib/bpb": 1.25 - step / 1000,
                    "eval/tokenized/prose/loss": 3.75 - step / 200,
                    "eval/tokenized/prose/bpb": 1.5 - step / 2000,
                    "eval/loss": 3.625 - step / 150,
                }
            )
    lines.append({"step": STEPS, "lm_eval/arc_easy/acc": 0.3125, "lm_eval/averages/macro_acc": 0.3})
    text = "\n".join(json.dumps(line) for line in lines) + "\n"
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text(text + '{"step": 61, "train/lo')  # killed mid-append
    summary = {"wall_time_seconds": 3723.0, "lm_eval/hellaswag/acc_norm": 0.2875}
    (run_dir / "tracker_metrics.jsonl").write_text(json.dumps({"config": {}, "summary": summary}))
    (run_dir / "artifact.json").write_text(
        json.dumps({"name": "checkpoints/tiny", "version": "v7", "fingerprint": "feedbeef"})
    )
    for step, temporary in ((40, False), (55, True)):
        folder = run_dir / "checkpoints" / f"step-{step}"
        folder.mkdir(parents=True)
        (folder / "metadata.json").write_text(json.dumps({"step": step, "is_temporary": temporary}))
    (run_dir / "checkpoints" / "step-58").mkdir()  # a save that never finished


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR"
    header = data[16 : 16 + length]
    assert zlib.crc32(kind + header) == struct.unpack(">I", data[16 + length : 20 + length])[0]
    width, height = struct.unpack(">II", header[:8])
    assert data.endswith(b"IEND\xaeB`\x82")
    return width, height


def test_plot_is_a_valid_png(tmp_path: Path) -> None:
    _write_run(tmp_path)
    out = tmp_path / "plots" / "training.png"
    write_training_plot(tmp_path / "metrics.jsonl", out)
    width, height = _png_size(out.read_bytes())
    assert width > 300 and height > 300
    assert out.stat().st_size > 10_000  # three panels of lines, not a blank canvas
    assert [p.name for p in out.parent.iterdir()] == ["training.png"]  # no temp file left


def test_metrics_merge_lines_of_one_step_and_skip_a_torn_last_line(tmp_path: Path) -> None:
    _write_run(tmp_path)
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert records[EVAL_EVERY - 1]["train/loss"] == _train_loss(EVAL_EVERY)
    assert records[EVAL_EVERY - 1]["eval/loss"] == 3.625 - EVAL_EVERY / 150


def test_damaged_metrics_line_is_an_error_naming_the_line(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(MetricsError, match=r"metrics.jsonl:2"):
        read_metrics(tmp_path / "metrics.jsonl")


def test_report_table_holds_the_numbers(tmp_path: Path) -> None:
    _write_run(tmp_path)
    report = format_report(tmp_path)
    assert "checkpoints/tiny v7 (fingerprint feedbeef)" in report
    assert "1..60 (60 records)" in report
    final = f"{_train_loss(STEPS):.4f}"
    assert f"final {final} (step 60), best {final} (step 60)" in report
    assert "median 4,031" in report  # steps 2..60: 4002..4060, the compile step left out
    assert "1:02:03" in report
    stdlib_row = next(line for line in report.splitlines() if "tokenized/stdlib" in line)
    assert f"{1.25 - 0.06:.4f}" in stdlib_row and f"{3.5 - 0.6:.4f}" in stdlib_row
    prose_row = next(line for line in report.splitlines() if "tokenized/prose" in line)
    assert f"{1.5 - 0.03:.4f}" in prose_row and f"{3.75 - 0.3:.4f}" in prose_row
    assert "lm_eval/arc_easy/acc" in report and "0.3125" in report
    assert "lm_eval/hellaswag/acc_norm" in report and "0.2875" in report
    assert "step-40  permanent" in report and "step-55  temporary" in report
    assert "step-58  incomplete" in report


def test_report_cli(tmp_path: Path) -> None:
    _write_run(tmp_path)
    env_path = python_env()
    done = subprocess.run(
        [sys.executable, "-m", "kiln.report", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env_path,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == format_report(tmp_path)
    missing = subprocess.run(
        [sys.executable, "-m", "kiln.report", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        env=env_path,
    )
    assert missing.returncode == 1
    assert "metrics.jsonl does not exist" in missing.stderr and "Traceback" not in missing.stderr


def test_the_plot_draws_groups_by_their_macro_average() -> None:
    record = {key: 1.0 for key in (
        "eval/loss", "eval/macro_loss", "eval/total_time", "eval/heldout/loss",
        "eval/paloma/c4_en/loss", "eval/paloma/ptb/loss", "eval/paloma/macro_loss",
        "eval/paloma/micro_loss", "eval/uncheatable/bbc/loss", "eval/uncheatable/macro_loss",
    )}  # fmt: skip
    assert eval_loss_keys([record]) == [
        "eval/heldout/loss", "eval/loss", "eval/paloma/macro_loss", "eval/uncheatable/macro_loss"
    ]  # fmt: skip
