"""write_run_summary on what a real (tiny) training run ends with."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

# The trainer tests' helpers: real caches with the committed tokenizer, a tiny-model spec.
from kiln_testing.data import STDLIB_TOKENIZER
from kiln_testing.training import build_tiny_cache, make_spec

from kiln.artifacts import SUMMARY_TEXT_FILE, TRAIN_SPEC_FILE
from kiln.artifacts.atomic import atomic_write_json
from kiln.data.cache import TokenCache
from kiln.data.tokenizer import load_tokenizer
from kiln.report.baseline import unigram_baseline
from kiln.report.plots import plot_run
from kiln.report.run_summary import shown_prompt, write_run_summary
from kiln.train.spec import parse_spec
from kiln.train.trainer import FinishedRun, open_trainer

SEQ_LEN = 32


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> FinishedRun:
    folder = tmp_path_factory.mktemp("run")
    train_cache = build_tiny_cache(folder, "tokenized/a", 60, seed=0)
    val_cache = build_tiny_cache(folder, "tokenized/val", 12, seed=1)
    output = folder / "out"
    spec = make_spec(output, {"tokenized/a": train_cache}, {"tokenized/val": val_cache},
                     **{"config.num_train_steps": 3, "config.seq_len": SEQ_LEN,
                        "runtime.checkpointer.every": None})  # fmt: skip
    output.mkdir()
    atomic_write_json(output / "train_spec.json", spec)  # the record kiln.runner writes
    with open_trainer(parse_spec(spec), plot_run) as trainer:
        return trainer.run()


def test_summary_shows_losses_baseline_locations_and_samples(finished: FinishedRun) -> None:
    text = write_run_summary(finished)
    finished_run = finished.spec.output_path
    assert (finished_run / SUMMARY_TEXT_FILE).read_text() == text
    summary = json.loads((finished_run / "summary.json").read_text())
    assert summary == finished.summary
    assert re.search(rf"^  train \(last step\) +{summary['train/loss']:.3f}$", text, re.MULTILINE)
    spec = json.loads((finished_run / TRAIN_SPEC_FILE).read_text())["config"]
    train_cache = TokenCache.open(spec["datasets"][0]["path"])
    val_cache = TokenCache.open(spec["validation"][0]["path"])
    windows = 2 * 4  # runtime.max_eval_batches x config.batch_size in trainer_testing's spec
    unigram = unigram_baseline(
        [(train_cache, 1.0)], val_cache, seq_len=SEQ_LEN, num_windows=windows
    )
    val_loss = summary["eval/val/loss"]
    assert f"{val_loss:.3f}  vs unigram {unigram:.3f}: {val_loss - unigram:+.3f}" in text
    assert f"artifact    {finished_run}" in text
    assert str(finished_run / "checkpoints/step-3") in text
    assert f"loss curve  {finished_run / 'plots/training.png'}\n" in text
    samples = re.findall(r"\[(\d)\] prompt: '.+'\n +model: +['\"]", text)
    assert samples == ["1", "2", "3"]
    assert write_run_summary(finished) == text  # a fixed seed: the same samples again


def test_a_missing_plot_and_unloadable_tokenizer_are_notes(
    finished: FinishedRun, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    shutil.copytree(finished.spec.output_path, run)
    (run / "plots/training.png").unlink()
    spec = json.loads((run / TRAIN_SPEC_FILE).read_text())
    spec["output_path"] = str(run)
    cache = Path(spec["config"]["validation"][0]["path"])
    moved = tmp_path / "val"
    shutil.copytree(cache, moved)
    info = json.loads((moved / "cache.json").read_text())
    info["tokenizer"]["spec"]["path"] = "no/such/tokenizer"
    (moved / "cache.json").write_text(json.dumps(info))
    spec["config"]["validation"][0]["path"] = str(moved)
    train_cache = finished.caches[0]
    text = write_run_summary(
        dataclasses.replace(
            finished, spec=parse_spec(spec), caches=(train_cache, TokenCache.open(moved))
        )
    )
    assert "training.png  (missing" in text
    assert "Samples: skipped (cannot load the tokenizer" in text
    assert "vs unigram" in text


def test_a_prompt_cut_inside_a_character_is_shown_from_the_next_one() -> None:
    tokenizer = load_tokenizer(STDLIB_TOKENIZER)
    ids = tokenizer.hf_tokenizer.encode("点。 over body", add_special_tokens=False)
    assert tokenizer.decode(ids[1:]).startswith("\ufffd")  # the cut this is about
    assert shown_prompt(tokenizer, np.array(ids[1:])) == "…。 over body"
    assert shown_prompt(tokenizer, np.array(ids)) == "点。 over body"
