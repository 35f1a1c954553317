from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from kiln_testing.training import read_jsonl

from kiln.train.metrics import (
    MetricsLogger,
    Throughput,
    WandbSettings,
    peak_flops_per_device,
    rewind_metrics_file,
)
from kiln.train.progress import make_progress
from kiln.train.spec import WandbSpec


def test_lines_are_appended_and_latest_values_kept(tmp_path: Path) -> None:
    logger = MetricsLogger(tmp_path, resume_step=0, wandb=None)
    logger.log(1, {"train/loss": 3.5, "optim/learning_rate": 1e-3})
    logger.log(1, {"eval/loss": 3.25})
    logger.log(2, {"train/loss": 3.0})
    assert read_jsonl(tmp_path / "metrics.jsonl") == [
        {"step": 1, "train/loss": 3.5, "optim/learning_rate": 1e-3},
        {"step": 1, "eval/loss": 3.25},
        {"step": 2, "train/loss": 3.0},
    ]
    assert logger.latest == {"train/loss": 3.0, "optim/learning_rate": 1e-3, "eval/loss": 3.25}
    logger.close()


def test_a_resumed_run_rewinds_to_its_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    lines = [{"step": s, "train/loss": 10.0 - s} for s in range(1, 8)] + [
        {"step": 5, "eval/loss": 2}
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"step": 8, "train/lo')
    latest = rewind_metrics_file(path, last_step=5)
    assert [r["step"] for r in read_jsonl(path)] == [1, 2, 3, 4, 5, 5]
    assert latest == {"train/loss": 5.0, "eval/loss": 2}
    logger = MetricsLogger(tmp_path, resume_step=3, wandb=None)
    logger.log(4, {"train/loss": 1.0})
    logger.close()
    assert [r["step"] for r in read_jsonl(path)] == [1, 2, 3, 4]


def test_wandb_settings_spec_then_variables_then_defaults() -> None:
    name, version = "checkpoints/quickstart", "2026.11.29"
    assert WandbSettings.resolve(WandbSpec(), name, version, environ={}) == WandbSettings(
        "offline", "kiln", None, None, "checkpoints-quickstart-2026.11.29", ()
    )
    environ = {"WANDB_MODE": "disabled", "WANDB_PROJECT": "p", "WANDB_ENTITY": "lab",
               "WANDB_RUN_GROUP": "g", "WANDB_RUN_ID": "from-env", "WANDB_TAGS": "a, b,"}  # fmt: skip
    assert WandbSettings.resolve(WandbSpec(), name, version, environ) == WandbSettings(
        "disabled", "p", "lab", "g", "from-env", ("a", "b")
    )
    explicit = WandbSpec("online", "marin", "team", "run/1", group="dclm", tags=("DCLM_1B_1X",))
    assert WandbSettings.resolve(explicit, name, version, environ) == WandbSettings(
        "online", "marin", "team", "dclm", "run-1", ("DCLM_1B_1X",)
    )
    with pytest.raises(ValueError, match="W&B mode 'cloud' .from .WANDB_MODE. is not one of"):
        WandbSettings.resolve(WandbSpec(), name, version, {"WANDB_MODE": "cloud"})


def test_throughput_and_mfu() -> None:
    assert peak_flops_per_device("NVIDIA H200", "bfloat16") == 989e12
    assert peak_flops_per_device("NVIDIA H100 80GB HBM3", "bfloat16") == 989e12
    assert peak_flops_per_device("cpu", "bfloat16") is None
    assert peak_flops_per_device("NVIDIA H200", "float32") is None
    metrics = Throughput(tokens_per_step=1000, flops_per_token=6e9, peak_flops=2 * 989e12).metrics(
        0.5
    )
    assert metrics["throughput/tokens_per_second"] == 2000.0
    assert metrics["throughput/step_time"] == 0.5
    assert metrics["throughput/mfu"] == pytest.approx(2000 * 6e9 / (2 * 989e12))
    assert "throughput/mfu" not in Throughput(1000, 6e9, None).metrics(0.5)


def wandb_settings(mode: str) -> WandbSettings:
    return WandbSettings(mode, "kiln-tests", None, None, "checkpoints-test-2026.11.29", ())


def test_wandb_offline_run_is_written_under_output(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("WANDB_MODE", raising=False)
    logger = MetricsLogger(tmp_path, resume_step=0, wandb=wandb_settings("offline"))
    logger.log(1, {"train/loss": 2.0})
    logger.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*-checkpoints-test-2026.11.29"))
    assert len(runs) == 1 and any(runs[0].glob("*.wandb"))


def test_a_wandb_failure_does_not_stop_logging(tmp_path: Path, caplog, monkeypatch) -> None:
    monkeypatch.delenv("WANDB_MODE", raising=False)
    logger = MetricsLogger(tmp_path, resume_step=0, wandb=wandb_settings("not-a-mode"))
    with caplog.at_level(logging.ERROR, logger="kiln.train.metrics"):
        for step in range(1, 4):
            logger.log(step, {"train/loss": 1.0 / step})
        logger.close()
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 3]
    failures = [r for r in caplog.records if "W&B logging failed" in r.getMessage()]
    assert len(failures) == 1  # logged once, then W&B is off for the run


def test_progress_log_lines_and_bar(capsys) -> None:
    log_progress = make_progress("log", total_steps=100, start_step=0)
    for step in range(1, 5):
        log_progress.update(step, loss=3.0 / step, tokens_per_second=1000.0)
    log_progress.message("saved temporary checkpoint x")
    lines = capsys.readouterr().out.splitlines()
    # One line per 2% of the run (every 2 steps of 100), and every message.
    assert [line.split(" eta ")[0] for line in lines[:2]] == [
        "step 2/100 loss 1.5000 tok/s 1000",
        "step 4/100 loss 0.7500 tok/s 1000",
    ]
    assert lines[2] == "saved temporary checkpoint x"

    bar = make_progress("bar", total_steps=10, start_step=3)
    bar.update(4, loss=2.5, tokens_per_second=10.0)
    bar.message("resumed")
    bar.close()
    assert "resumed" in capsys.readouterr().out
    quiet = make_progress("none", total_steps=10, start_step=0)
    quiet.update(1, loss=1.0, tokens_per_second=1.0)
    quiet.message("only messages")
    assert capsys.readouterr().out == "only messages\n"
