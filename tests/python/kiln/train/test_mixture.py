from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from kiln_testing.training import build_tiny_cache

from kiln.data.cache import TokenCache
from kiln.data.mixture import (
    MixtureDataset,
    MixtureError,
    block_counts,
    feistel_permutation,
    fixed_batches,
    mixture_block_size,
    staged_block_size,
)

SEQ_LEN = 32


@pytest.fixture(scope="module")
def caches(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TokenCache]:
    folder = tmp_path_factory.mktemp("caches")
    sizes = {"a": 120, "b": 40, "tiny": 1}
    return {n: TokenCache.open(build_tiny_cache(folder, n, size, seed=i))
            for i, (n, size) in enumerate(sizes.items())}  # fmt: skip


def test_block_counts_use_largest_remainders() -> None:
    # 3.8, 0.25, 0.055 of 2048 (sum 4.105): 1895.81, 124.73, 27.44 -> floors 1895, 124, 27 (2046);
    # the 2 left over go to the largest fractional parts, .81 and .73.
    assert block_counts([3.8, 0.25, 0.055], 2048).tolist() == [1896, 125, 27]
    # 16 / 3 = 5.33 each: the one left over goes to the first of the equal remainders.
    assert block_counts([1, 1, 1], 16).tolist() == [6, 5, 5]
    assert block_counts([1, 0], 8).tolist() == [8, 0]
    with pytest.raises(MixtureError):
        block_counts([0, 0], 8)


@pytest.mark.parametrize("n", [1, 2, 5, 64, 1000, 4097])
def test_feistel_permutation_is_a_bijection(n: int) -> None:
    keys = np.random.SeedSequence([7]).generate_state(4, dtype=np.uint64)
    permuted = feistel_permutation(np.arange(n), n, keys)
    assert sorted(permuted.tolist()) == list(range(n))


def test_feistel_keys_change_the_order() -> None:
    n = 1000
    a, b = (feistel_permutation(np.arange(n), n, np.random.SeedSequence([s]).generate_state(4, np.uint64))
            for s in (1, 2))  # fmt: skip
    assert (a != b).mean() > 0.9 and (a != np.arange(n)).mean() > 0.9


def test_batches_are_a_pure_function_of_the_step(caches: dict[str, TokenCache]) -> None:
    components = [(caches["a"], 0.75), (caches["b"], 0.25)]
    forward = MixtureDataset(components, SEQ_LEN, seed=3, block_size=16)
    backward = MixtureDataset(components, SEQ_LEN, seed=3, block_size=16)
    in_order = [forward.batch(step, 4) for step in range(10)]
    reversed_order = [backward.batch(step, 4) for step in reversed(range(10))][::-1]
    for x, y in zip(in_order, reversed_order):
        for key in ("tokens", "segment_ids", "loss_mask"):
            np.testing.assert_array_equal(x[key], y[key])
    other_seed = MixtureDataset(components, SEQ_LEN, seed=4, block_size=16).batch(0, 4)
    assert not np.array_equal(other_seed["tokens"], in_order[0]["tokens"])


def test_each_block_holds_the_weighted_counts(caches: dict[str, TokenCache]) -> None:
    mixture = MixtureDataset(
        [(caches["a"], 3.0), (caches["b"], 1.0)], SEQ_LEN, seed=0, block_size=16
    )
    assert mixture.counts.tolist() == [12, 4]
    for block in range(3):  # a batch of 8 is half a block: two batches per block
        rows = mixture.sources(2 * block, 8) + mixture.sources(2 * block + 1, 8)
        assert Counter(d for d, _ in rows) == {0: 12, 1: 4}
    orders = [[d for d, _ in mixture.sources(2 * block, 8)] for block in range(3)]
    assert len({tuple(o) for o in orders}) > 1  # the order within blocks is permuted


def test_rows_are_the_cache_windows_named_by_sources(caches: dict[str, TokenCache]) -> None:
    mixture = MixtureDataset(
        [(caches["a"], 1.0), (caches["b"], 1.0)], SEQ_LEN, seed=1, block_size=8
    )
    batch = mixture.batch(5, 6)
    for row, (d, window) in enumerate(mixture.sources(5, 6)):
        expected = [caches["a"], caches["b"]][d].windows([window], SEQ_LEN)
        np.testing.assert_array_equal(batch["tokens"][row], expected.tokens[0])
        np.testing.assert_array_equal(batch["segment_ids"][row], expected.segment_ids[0])
        np.testing.assert_array_equal(batch["loss_mask"][row], expected.loss_mask[0])
    assert batch["tokens"].dtype == np.int32 and batch["loss_mask"].dtype == np.float32


def test_datasets_wrap_around_with_a_new_shuffle_each_epoch(caches: dict[str, TokenCache]) -> None:
    n = caches["b"].num_windows(SEQ_LEN)
    mixture = MixtureDataset([(caches["b"], 1.0)], SEQ_LEN, seed=0, block_size=4)
    windows = [w for _, w in mixture.sources(0, 3 * n)]
    epochs = [windows[e * n : (e + 1) * n] for e in range(3)]
    for epoch in epochs:
        assert sorted(epoch) == list(range(n))  # every window once per epoch
    assert epochs[0] != epochs[1] and epochs[1] != epochs[2]
    assert epochs[0] != list(range(n))  # shuffled


def test_zero_weight_datasets_drop_out(caches: dict[str, TokenCache]) -> None:
    mixture = MixtureDataset(
        [(caches["b"], 0.0), (caches["a"], 1.0)], SEQ_LEN, seed=0, block_size=8
    )
    assert {d for d, _ in mixture.sources(0, 32)} == {0}  # the position among active datasets
    a_only = MixtureDataset([(caches["a"], 1.0)], SEQ_LEN, seed=0, block_size=8)
    # The shuffle key is the position in the list given, so it differs from a list without b.
    assert mixture.sources(0, 32) != a_only.sources(0, 32)
    with pytest.raises(MixtureError, match="no dataset with a weight > 0"):
        MixtureDataset([(caches["a"], 0.0)], SEQ_LEN, seed=0)


def test_a_dataset_shorter_than_one_window_is_refused(caches: dict[str, TokenCache]) -> None:
    with pytest.raises(MixtureError, match="tiny.*fewer tokens than one window of seq_len=4096"):
        MixtureDataset([(caches["tiny"], 1.0)], 4096, seed=0)


def test_fixed_batches_are_the_first_windows_padded(caches: dict[str, TokenCache]) -> None:
    cache = caches["a"]
    batches = fixed_batches(cache, SEQ_LEN, batch_size=4, num_batches=3)
    assert len(batches) == 3
    first = cache.windows(range(12), SEQ_LEN)
    np.testing.assert_array_equal(np.concatenate([b["tokens"] for b in batches]), first.tokens)

    windows = caches["b"].num_windows(SEQ_LEN)
    few = fixed_batches(caches["b"], SEQ_LEN, batch_size=windows + 3, num_batches=2)
    assert len(few) == 1 and few[0]["tokens"].shape == (windows + 3, SEQ_LEN)
    assert few[0]["loss_mask"][windows:].sum() == 0 and few[0]["tokens"][windows:].sum() == 0
    assert few[0]["loss_mask"][:windows].sum() > 0


def test_loss_positions_all_counts_every_position_but_the_last(
    caches: dict[str, TokenCache],
) -> None:
    # Levanter's mask: a document's last token also predicts the next document's first.
    components = [(caches["a"], 1.0)]
    within = MixtureDataset(components, SEQ_LEN, seed=3).batch(0, 4)
    everywhere = MixtureDataset(components, SEQ_LEN, seed=3, loss_positions="all").batch(0, 4)
    np.testing.assert_array_equal(within["tokens"], everywhere["tokens"])
    np.testing.assert_array_equal(within["segment_ids"], everywhere["segment_ids"])
    assert (everywhere["loss_mask"][:, :-1] == 1).all() and (everywhere["loss_mask"][:, -1] == 0).all()
    boundaries = within["segment_ids"][:, 1:] != within["segment_ids"][:, :-1]
    assert boundaries.any()  # the windows cross documents, so the masks differ there only
    np.testing.assert_array_equal(within["loss_mask"][:, :-1] == 0, boundaries)

    windows = caches["b"].num_windows(SEQ_LEN)
    padded = fixed_batches(caches["b"], SEQ_LEN, windows + 3, 1, loss_positions="all")[0]
    assert padded["loss_mask"][windows:].sum() == 0  # padding rows still count nothing
    assert padded["loss_mask"][:windows].sum() == windows * (SEQ_LEN - 1)


def test_stages_change_the_weights_and_read_on_where_the_last_left_off(
    caches: dict[str, TokenCache],
) -> None:
    """Levanter's varying mixture: from sequence 32 on only dataset b is read; a's stage-0
    sequences are the one-stage mixture's, and b's later ones continue its count (the next
    windows of the same shuffle), never repeating a window within an epoch."""
    a, b = caches["a"], caches["b"]
    one = MixtureDataset([(a, 1.0), (b, 1.0)], SEQ_LEN, seed=3, block_size=16)
    staged = MixtureDataset([(a, 1.0), (b, 1.0)], SEQ_LEN, seed=3, block_size=16,
                            stages=[(32, [0.0, 1.0])])  # fmt: skip
    assert staged.sources(0, 32) == one.sources(0, 32)  # stage 0 is the mixture of stage 0
    later = staged.sources(4, 8) + staged.sources(5, 8)
    assert {d for d, _ in later} == {1}
    reads_of_b = [w for d, w in staged.sources(0, 48) if d == 1]  # 16 + 16 of its sequences
    windows = b.num_windows(SEQ_LEN)
    assert len(reads_of_b) == 32 <= windows and len(set(reads_of_b)) == 32
    assert staged.batch(5, 8)["tokens"].tolist() == staged.batch(5, 8)["tokens"].tolist()
    assert staged.sequences_per_block(["a", "b"]) == [
        {"start": 0, "counts": {"a": 8, "b": 8}}, {"start": 32, "counts": {"b": 16}}
    ]


def test_a_stage_must_start_on_a_block(caches: dict[str, TokenCache]) -> None:
    with pytest.raises(MixtureError, match="multiples of the block size"):
        MixtureDataset([(caches["a"], 1.0), (caches["b"], 1.0)], SEQ_LEN, seed=3, block_size=16,
                       stages=[(24, [0.0, 1.0])])  # fmt: skip
    assert staged_block_size(80, [40, 120]) == 40  # a short run: its 80 sequences
    assert staged_block_size(2048, [5_120_000]) == 2048  # dclm_1b at step 20000


def test_levanters_order_reads_levanters_blocks(caches: dict[str, TokenCache]) -> None:
    assert mixture_block_size(16, 5, stage_starts=[40]) == 40  # Kiln's: the run's, its stages'
    assert mixture_block_size(16, 5, stage_starts=[40], data_order="levanter") == 2048
    with pytest.raises(MixtureError, match="Levanter's data order reads blocks of 2048"):
        MixtureDataset([(caches["a"], 1.0)], SEQ_LEN, seed=3, block_size=80, data_order="levanter")
    with pytest.raises(MixtureError, match="data_order must be kiln or levanter, got 'marin'"):
        MixtureDataset([(caches["a"], 1.0)], SEQ_LEN, seed=3, data_order="marin")


def windows_read(mixture: MixtureDataset, steps: range, batch: int) -> dict[int, list[int]]:
    """Each active dataset's windows, in the order the stream reads them."""
    read: dict[int, list[int]] = {}
    for step in steps:
        for d, window in mixture.sources(step, batch):
            read.setdefault(d, []).append(window)
    return read


def test_a_derived_stream_reads_on_where_its_parent_stopped(caches: dict[str, TokenCache]) -> None:
    """A child's shared cache continues the parent's shuffle from the parent's position, also
    across the parent's stage change and an epoch; a new cache starts at its beginning; the
    child's own position is its start plus what it read (a grandchild's start)."""
    parent = MixtureDataset([(caches["a"], 1.0), (caches["b"], 0.0)], SEQ_LEN, seed=3,
                            block_size=16, stages=[(48, [0.5, 0.5])], fingerprints=["A", "B"])  # fmt: skip
    uninterrupted = windows_read(parent, range(60), 4)  # past an epoch of b (40 windows)
    at = parent.position(25 * 4)  # the parent's step 25: a stage and a partial block behind it
    assert at.datasets["A"][1] + at.datasets["B"][1] == 100
    assert at.datasets == {"A": (0, 74), "B": (1, 26)} and at.seed == 3
    child = MixtureDataset([(caches["b"], 0.5), (caches["a"], 0.5)], SEQ_LEN, seed=9,
                           block_size=8, fingerprints=["B", "A"], start=at)  # fmt: skip
    continued = windows_read(child, range(10), 4)
    assert continued[1] == uninterrupted[0][74 : 74 + len(continued[1])]  # a, in its shuffle
    assert continued[0] == uninterrupted[1][26 : 26 + len(continued[0])]  # b, into its 2nd epoch
    assert child.position(10 * 4).datasets == {"A": (0, 74 + 20), "B": (1, 26 + 20)}
    # A cache the parent did not read starts afresh, in a shuffle keyed apart from the parent's.
    fresh = MixtureDataset([(caches["tiny"], 0.0), (caches["b"], 1.0)], SEQ_LEN, seed=9,
                           block_size=8, fingerprints=["T", "C"], start=at)  # fmt: skip
    assert fresh.position(0).datasets == {"C": (3, 0)}
    with pytest.raises(MixtureError, match="reset_data_loader_on_init=True"):
        MixtureDataset([(caches["a"], 1.0)], SEQ_LEN, seed=0, block_size=2048,
                       data_order="levanter", fingerprints=["A"], start=at)  # fmt: skip
