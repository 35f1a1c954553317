"""cuDNN's packed layout of segment ids (kiln.model.attention.cudnn_packed_layout), on CPU.

cuDNN itself needs a GPU: the benchmarks run it there (benchmarks/RESULTS.md). Here the layout
is checked against what it must mean: a token attends to the tokens of its own run.
"""

from __future__ import annotations

import numpy as np
import pytest

from kiln.model.attention import cudnn_packed_layout


def mask_of_layout(lengths: np.ndarray, offsets: np.ndarray, seq_len: int) -> np.ndarray:
    """bool [B, T, T]: True where two tokens lie in the same (offset, length) run of a row."""
    runs = np.full((len(lengths), seq_len), -1)
    for row, (row_lengths, row_offsets) in enumerate(zip(lengths, offsets)):
        for run, (length, start) in enumerate(zip(row_lengths, row_offsets)):
            if length >= 0:
                assert runs[row, start : start + length].max() == -1, "runs overlap"
                runs[row, start : start + length] = run
    assert (runs >= 0).all(), "a token outside every run"
    return runs[:, :, None] == runs[:, None, :]


def test_the_layout_means_the_segment_mask() -> None:
    rng = np.random.default_rng(0)
    rows = []
    for documents in (1, 3, 7):
        starts = np.zeros(64, np.int64)
        starts[rng.choice(np.arange(1, 64), size=documents - 1, replace=False)] = 1
        rows.append(np.cumsum(starts))
    segment_ids = np.stack(rows).astype(np.int32)
    lengths, offsets, fits = cudnn_packed_layout(segment_ids, max_segments=8)
    assert bool(fits)
    assert lengths.shape == (3, 8) and offsets.shape == (3, 9)
    assert (np.asarray(offsets)[:, -1] == -1).all()  # cuDNN's M + 1 entries, -1 padded
    np.testing.assert_array_equal(
        mask_of_layout(np.asarray(lengths), np.asarray(offsets), 64),
        segment_ids[:, :, None] == segment_ids[:, None, :],
    )
    np.testing.assert_array_equal(np.asarray(lengths)[0], [64] + [-1] * 7)


@pytest.mark.parametrize(
    "segment_ids, why",
    [
        ([[0, 0, 1, 2, 3, 4, 5, 5]], "more runs than max_segments"),
        ([[0, 0, 1, 1, 0, 0, 2, 2]], "an id recurring after another: one segment, two runs"),
    ],
)
def test_layouts_it_cannot_describe_are_flagged(segment_ids, why: str) -> None:
    _, _, fits = cudnn_packed_layout(np.asarray(segment_ids, np.int32), max_segments=4)
    assert not bool(fits), why
