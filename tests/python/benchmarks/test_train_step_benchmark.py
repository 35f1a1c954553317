"""The train-step benchmark runs on CPU at a tiny size under every segment layout, with the
persistent compilation cache and a profile per row; the docs layout packs the corpus's documents
as training does; --memory adds the compiled step's memory."""

import dataclasses
import os
import re

import numpy as np
import pytest
import segment_layouts
import train_step

from kiln.model.config import num_parameters


def test_every_layout_gets_a_row_a_profile_and_the_cache_fills(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # --profile adds to them
    cache, profile = tmp_path / "jax-cache", tmp_path / "profile"
    train_step.main(
        ["--model", "tiny", "--attention", "xla", "--batch-size", "2", "--seq-len", "64",
         "--vocab-size", "512", "--steps", "1", "--warmup-steps", "1", "--compile-cache", str(cache),
         "--profile", str(profile), "--profile-steps", "1"]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert "failed" not in out, out
    small_vocabulary = dataclasses.replace(train_step.MODELS["tiny"], vocab_size=512)
    assert f"model tiny: {num_parameters(small_vocabulary) / 1e6:.1f}M params" in out, out
    rows = [line.split() for line in out.splitlines() if line.split()[:2] in
            (["none", "xla"], ["ones", "xla"], ["docs", "xla"])]  # fmt: skip
    assert [row[0] for row in rows] == ["none", "ones", "docs"], out
    for row in rows:
        assert row[4:6] == ["n/a", "n/a"]  # MFU in both conventions: no peak known for a CPU
        assert row[6] == "-"  # a CPU reports no peak memory
        assert float(row[7]) > 0 and float(row[8]) > 0  # first step cold and warm, in seconds
    assert any(cache.iterdir()), "the compilation cache stayed empty"
    # Each row's step split by category, from its own trace.
    assert out.count("where the step goes") == 3, out
    for layout in ("none", "ones", "docs"):
        assert list((profile / f"{layout}-xla").glob("plugins/profile/*/*.xplane.pb"))
    step_lines = [line.split() for line in out.splitlines() if line.split()[:1] == ["step"]]
    assert len(step_lines) == 3 and all(float(line[1]) > 0 for line in step_lines), out


def test_docs_windows_are_the_corpus_documents_in_order():
    lengths = segment_layouts.document_lengths()
    ids = segment_layouts.segment_ids("docs", 8, 1024, seed=1)
    assert ids.shape == (8, 1024) and (ids[:, 0] == 0).all()
    assert (np.diff(ids, axis=1) >= 0).all()  # documents numbered up from 0 in each window
    inner: list[int] = []  # lengths of the documents that start and end inside a window
    for row in ids:
        inner += np.diff(np.flatnonzero(np.diff(row)) + 1).tolist()
    assert inner and set(inner) <= set(lengths.tolist())  # the corpus's documents, whole


def test_memory_columns_give_the_compiled_peak_and_its_parts(capsys):
    train_step.main(
        ["--model", "tiny", "--attention", "xla", "--layouts", "none", "--batch-size", "2",
         "--seq-len", "64", "--vocab-size", "512", "--steps", "1", "--warmup-steps", "1",
         "--memory"]
    )  # fmt: skip
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("layout"))
    assert header.endswith("compiled GiB in use GiB reserved GiB"), out
    [row] = [line.split() for line in out.splitlines() if line.split()[:2] == ["none", "xla"]]
    assert float(row[-3]) > 0 and row[-2:] == ["-", "-"]  # a CPU reports no memory of its own
    parts = next(line for line in out.splitlines() if line.startswith("  compiled: arguments"))
    arguments, outputs, alias, temp, peak = (
        float(word) for word in re.findall(r"(\d+\.\d+)", parts)[:5]
    )
    assert peak == pytest.approx(arguments + outputs - alias + temp, abs=0.02)
    assert "the state (parameters, Adam's moments)" in parts, parts
