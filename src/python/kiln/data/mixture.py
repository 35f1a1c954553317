"""A deterministic weighted mixture of token caches, block by block (Marin/Levanter semantics).

The global sequence stream is cut into blocks of `block_size` sequences. Every block holds a
fixed count of sequences per dataset (weight x block_size, remainders to the largest fractional
parts), in an order permuted by a PRNG seeded with (seed, block index). The k-th sequence a dataset
contributes overall is its window `feistel_permutation(k mod W, key(seed, dataset, epoch))` where W
is its number of windows and epoch = k // W: each dataset is shuffled without materialising a
permutation (a 3.8T-token cache has ~1e9 windows) and wraps around into a fresh shuffle per epoch.

That is Kiln's order (KilnOrder); `data_order="levanter"` reads Levanter's instead
(kiln.data.levanter_order): the same blocks and stages, its counts, block order and shuffle.

Everything is a pure function of (seed, step), so a run resumed at step k reads exactly the
batches an uninterrupted run would. A run derived from another continues its parent's stream
(`StreamPosition`): each dataset the two share reads on in the parent's shuffle from the
sequence the parent stopped at; a new dataset starts at its beginning in a shuffle of its own.
See docs/training.md.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from kiln_contract.vocabulary import LEVANTER_MIXTURE_BLOCK

DEFAULT_BLOCK_SIZE = 2048
FEISTEL_ROUNDS = 4

# Stream labels keep the PRNG streams of different uses independent for one seed.
_BLOCK_ORDER_STREAM = 0
_DATASET_SHUFFLE_STREAM = 1

Batch = dict[str, np.ndarray]


class WindowSource(Protocol):
    """What the mixture needs from a token cache (kiln.data.cache.TokenCache)."""

    info: dict[str, Any]

    def num_windows(self, seq_len: int) -> int: ...

    def windows(self, indices: Sequence[int], seq_len: int) -> Any: ...


class WindowOrder(Protocol):
    """How a mixture orders its sequences: how many of each dataset a block holds, in which
    order, and which window a dataset's k-th sequence reads."""

    def block_counts(self, weights: Sequence[float], block_size: int) -> np.ndarray: ...

    def block_layout(self, block: int, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For each position in the block: which dataset, and its rank among that dataset's."""
        ...

    def window_indices(self, d: int, sequence_numbers: np.ndarray) -> np.ndarray: ...


class MixtureError(ValueError):
    """The mixture cannot be built from these caches/weights; the message says which."""


@dataclass(frozen=True)
class StreamPosition:
    """Where a mixture's stream stood after some sequences: for each dataset (by its cache's
    fingerprint), the key of the shuffle it is read in and the sequences it has given; and the
    seed of the shuffles. A checkpoint records it; a derived run starts from it."""

    seed: int
    datasets: dict[str, tuple[int, int]]  # fingerprint -> (shuffle key, sequences given)

    def to_json(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "datasets": {fp: {"key": key, "read": read}
                         for fp, (key, read) in sorted(self.datasets.items())},  # fmt: skip
        }

    @classmethod
    def from_json(cls, obj: Any) -> StreamPosition:
        try:
            datasets = {
                str(fp): (int(d["key"]), int(d["read"])) for fp, d in obj["datasets"].items()
            }
            return cls(int(obj["seed"]), datasets)
        except (KeyError, TypeError, ValueError, AttributeError):
            raise MixtureError(f"not a data position: {obj!r}") from None


def block_counts(weights: Sequence[float], block_size: int) -> np.ndarray:
    """Sequences per dataset in each block: weight share x block_size, largest remainder rounding.

    Ties between equal remainders go to the earlier dataset, so the counts are deterministic.
    """
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or len(w) == 0 or np.any(w < 0) or not np.isfinite(w).all() or w.sum() <= 0:
        raise MixtureError(f"mixture weights must be finite, >= 0 and not all 0, got {list(w)}")
    exact = w / w.sum() * block_size
    counts = np.floor(exact).astype(np.int64)
    remainder_order = np.argsort(-(exact - counts), kind="stable")
    counts[remainder_order[: block_size - counts.sum()]] += 1
    return counts


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a cheap, well-mixed hash of uint64 arrays (wraps mod 2**64)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def feistel_permutation(indices: np.ndarray, n: int, round_keys: np.ndarray) -> np.ndarray:
    """Maps `indices` (each in [0, n)) through a keyed pseudo-random permutation of [0, n).

    A balanced Feistel network is a bijection on [0, 4**h) for any round function; cycle walking
    (re-applying it while a value falls outside [0, n)) restricts that bijection to [0, n).
    The domain is < 4n, so a value walks fewer than 4 times on average.
    """
    half_bits = max(1, (max(n - 1, 1).bit_length() + 1) // 2)
    mask = np.uint64((1 << half_bits) - 1)
    shift = np.uint64(half_bits)

    def permute_domain(x: np.ndarray) -> np.ndarray:
        left, right = x >> shift, x & mask
        for key in round_keys:
            left, right = right, left ^ (_mix64(right ^ key) & mask)
        return (left << shift) | right

    x = permute_domain(np.asarray(indices, dtype=np.uint64))
    outside = x >= np.uint64(n)
    while outside.any():
        x[outside] = permute_domain(x[outside])
        outside = x >= np.uint64(n)
    return x.astype(np.int64)


def mixture_block_size(
    batch_size: int,
    num_train_steps: int,
    stage_starts: Sequence[int] = (),
    data_order: str | None = None,
) -> int:
    """Kiln's order: Marin's 2048 sequences per block, or the whole run when it is shorter than
    one block, so a small run sees its mixture weights exactly; then the largest size that also
    divides every stage's first sequence. Levanter's order: its 2048, always."""
    if data_order == "levanter":
        return LEVANTER_MIXTURE_BLOCK
    return staged_block_size(min(DEFAULT_BLOCK_SIZE, batch_size * num_train_steps), stage_starts)


class KilnOrder:
    """Largest-remainder counts, blocks ordered by PCG64 streams, and a fresh Feistel shuffle of
    each dataset per epoch."""

    block_counts = staticmethod(block_counts)

    def __init__(self, seed: int, block_size: int, dataset_keys: Sequence[int],
                 num_windows: Sequence[int], shuffle_seed: int | None = None):  # fmt: skip
        self.seed = seed
        self.shuffle_seed = seed if shuffle_seed is None else shuffle_seed
        self.block_size = block_size
        # The position in the mixture's components (not among active ones) keys each dataset's
        # shuffle, so adding a zero-weight entry does not reshuffle the others.
        self._dataset_keys = list(dataset_keys)
        self._num_windows = list(num_windows)

    def block_layout(self, block: int, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        assignment = np.repeat(np.arange(len(counts)), counts)
        rng = np.random.Generator(np.random.PCG64([self.seed, _BLOCK_ORDER_STREAM, block]))
        dataset_at = assignment[rng.permutation(self.block_size)]
        rank_at = np.empty(self.block_size, dtype=np.int64)
        for d in range(len(counts)):
            positions = np.flatnonzero(dataset_at == d)
            rank_at[positions] = np.arange(len(positions))
        return dataset_at, rank_at

    def window_indices(self, d: int, sequence_numbers: np.ndarray) -> np.ndarray:
        """Shuffled, a new shuffle per epoch."""
        n = self._num_windows[d]
        epochs, offsets = np.divmod(sequence_numbers, n)
        windows = np.empty_like(sequence_numbers)
        for epoch in np.unique(epochs):
            in_epoch = epochs == epoch
            windows[in_epoch] = feistel_permutation(
                offsets[in_epoch], n, self._round_keys(d, epoch)
            )
        return windows

    def _round_keys(self, d: int, epoch: int) -> np.ndarray:
        entropy = [self.shuffle_seed, _DATASET_SHUFFLE_STREAM, self._dataset_keys[d], int(epoch)]
        return np.random.SeedSequence(entropy).generate_state(FEISTEL_ROUNDS, dtype=np.uint64)


class MixtureDataset:
    """Batches drawn from weighted token caches; `batch(step, batch_size)` is a pure function.

    `components` pairs each cache with its weight; zero-weight caches drop out (a validation set
    listed at weight 0 is read only by validation). `block_size` is the number of sequences per
    mixture block: 2048 like Marin; a smaller block (a multiple of the batch size) makes a short
    run see the exact proportions sooner. `loss_positions` chooses the loss mask
    (window_loss_mask).

    `stages` changes the weights over training (Levanter's varying mixture): each is (the
    sequence it starts at, a multiple of `block_size`; a weight per component). A dataset's
    sequences continue across stages, so a stage reads on where the last left off in the same
    shuffle; a dataset without weight in one stage sits it out.

    `fingerprints` names each component's cache; with `start` (a parent run's StreamPosition,
    Kiln's order only) a component the parent read continues the parent's shuffle of it from
    where the parent stopped, and the others start afresh in shuffles keyed apart from the
    parent's. `position(sequences)` is where this stream stands after so many sequences.
    """

    def __init__(
        self,
        components: Sequence[tuple[WindowSource, float]],
        seq_len: int,
        seed: int,
        block_size: int = DEFAULT_BLOCK_SIZE,
        loss_positions: str | None = None,
        stages: Sequence[tuple[int, Sequence[float]]] = (),
        data_order: str | None = None,
        fingerprints: Sequence[str] | None = None,
        start: StreamPosition | None = None,
    ):
        if seed < 0:
            raise MixtureError(f"the mixture seed must be >= 0, got {seed}")
        if block_size < 1:
            raise MixtureError(f"block_size must be positive, got {block_size}")
        weights = [[w for _, w in components], *(list(w) for _, w in stages)]
        if any(len(w) != len(components) for w in weights):
            raise MixtureError("each mixture stage gives one weight per dataset")
        # Positions among the datasets some stage reads: what `sources` names.
        active = [i for i in range(len(components)) if any(w[i] > 0 for w in weights)]
        if not any(w > 0 for w in weights[0]):
            raise MixtureError("the mixture has no dataset with a weight > 0")
        self.seq_len = seq_len
        self.seed = seed
        self.block_size = block_size
        self.loss_positions = loss_positions
        self._active = active
        self._caches = [components[i][0] for i in active]
        self._num_windows = [self._windows_in(cache) for cache in self._caches]
        self._fingerprints = [None if fingerprints is None else fingerprints[i] for i in active]
        self._start = start
        self._keys, self._started = self._continuation(start)
        self._order = self._window_order(data_order)
        self._stages = self._stage_table([(0, weights[0]), *((s, w) for (s, _), w in
                                                             zip(stages, weights[1:]))], active)  # fmt: skip
        self.counts = self._stages[0].counts
        self._block_layout = functools.lru_cache(maxsize=4)(self._layout_of_block)

    def _continuation(self, start: StreamPosition | None) -> tuple[list[int], np.ndarray]:
        """Each active dataset's shuffle key and the sequences it gave before this stream: its
        position among the components, or with `start` the parent's key and count for a cache
        the parent read, and keys past the parent's for the others."""
        if start is None:
            return list(self._active), np.zeros(len(self._active), np.int64)
        if None in self._fingerprints:
            raise MixtureError("a mixture that continues a stream names its caches' fingerprints")
        fresh = 1 + max((key for key, _ in start.datasets.values()), default=-1)
        keys, started = [], []
        for i, fp in zip(self._active, self._fingerprints):
            key, read = start.datasets.get(str(fp), (fresh + i, 0))
            keys.append(key)
            started.append(read)
        return keys, np.asarray(started, np.int64)

    def position(self, sequences: int) -> StreamPosition:
        """Where the stream stands after its first `sequences` sequences (a checkpoint's step x
        batch size): what a run derived from this one continues from."""
        read = self._started.copy()
        block, offset = divmod(sequences, self.block_size)
        if block or offset:
            stage = self._stage_of(block)
            read = stage.base + (block - stage.start // self.block_size) * stage.counts
            if offset:
                dataset_at, _ = self._block_layout(block)
                read = read + np.bincount(dataset_at[:offset], minlength=len(read))
        seed = self.seed if self._start is None else self._start.seed
        return StreamPosition(seed, {str(fp): (key, int(n)) for fp, key, n in
                                     zip(self._fingerprints, self._keys, read)})  # fmt: skip

    def _window_order(self, data_order: str | None) -> WindowOrder:
        if data_order in (None, "kiln"):
            shuffle_seed = None if self._start is None else self._start.seed
            return KilnOrder(self.seed, self.block_size, self._keys, self._num_windows,
                             shuffle_seed)  # fmt: skip
        if data_order != "levanter":
            raise MixtureError(f"data_order must be kiln or levanter, got {data_order!r}")
        if self._start is not None:
            raise MixtureError(
                "a run continuing its parent's data reads Kiln's order, not Levanter's: give it "
                "`reset_data_loader_on_init=True` (every dataset from its beginning)"
            )
        if self.block_size != LEVANTER_MIXTURE_BLOCK:
            raise MixtureError(
                f"Levanter's data order reads blocks of {LEVANTER_MIXTURE_BLOCK} sequences, "
                f"not {self.block_size}"
            )
        from kiln.data.levanter_order import LevanterOrder  # imports jax: only when asked

        return LevanterOrder(self._num_windows, self.seed)

    def _layout_of_block(self, block: int) -> tuple[np.ndarray, np.ndarray]:
        return self._order.block_layout(block, self._stage_of(block).counts)

    def _stage_table(
        self, stages: list[tuple[int, Sequence[float]]], active: list[int]
    ) -> list[_Stage]:
        table: list[_Stage] = []
        for start, weights in stages:
            if start % self.block_size or (table and start <= table[-1].start):
                raise MixtureError(
                    f"a mixture stage starts at sequence {start}: stages must start in order, "
                    f"at multiples of the block size ({self.block_size} sequences)"
                )
            counts = self._order.block_counts([weights[i] for i in active], self.block_size)
            base = self._started.copy()
            if table:
                last = table[-1]
                base = last.base + (start - last.start) // self.block_size * last.counts
            table.append(_Stage(start, counts, base))
        return table

    def sequences_per_block(self, names: Sequence[str]) -> Any:
        """Each dataset's sequences in a block, by the name of its component (`names` in the
        order of `components`); with stages, a list of them by the sequence each stage starts
        at."""
        per_stage = [
            {names[key]: int(n) for key, n in zip(self._active, stage.counts) if n}
            for stage in self._stages
        ]
        if len(per_stage) == 1:
            return per_stage[0]
        return [{"start": stage.start, "counts": counts}
                for stage, counts in zip(self._stages, per_stage)]  # fmt: skip

    def _stage_of(self, block: int) -> _Stage:
        start = block * self.block_size
        return [stage for stage in self._stages if stage.start <= start][-1]

    def _windows_in(self, cache: WindowSource) -> int:
        n = cache.num_windows(self.seq_len)
        if n < 1:
            name = cache.info.get("name", "?")
            raise MixtureError(
                f"dataset {name} has fewer tokens than one window of seq_len={self.seq_len}; "
                "give it weight 0 or use a shorter seq_len"
            )
        return n

    def sources(self, step: int, batch_size: int) -> list[tuple[int, int]]:
        """(dataset position among active ones, window index) for each row of batch `step`."""
        sequence = step * batch_size + np.arange(batch_size, dtype=np.int64)
        blocks, positions = np.divmod(sequence, self.block_size)
        dataset_of_row = np.empty(batch_size, dtype=np.int64)
        number_of_row = np.empty(batch_size, dtype=np.int64)
        for block in np.unique(blocks):
            rows = np.flatnonzero(blocks == block)
            dataset_at, rank_at = self._block_layout(int(block))
            stage = self._stage_of(int(block))
            d = dataset_at[positions[rows]]
            dataset_of_row[rows] = d
            blocks_into_stage = block - stage.start // self.block_size
            number_of_row[rows] = (
                stage.base[d] + blocks_into_stage * stage.counts[d] + rank_at[positions[rows]]
            )
        window_of_row = np.empty(batch_size, dtype=np.int64)
        for d in np.unique(dataset_of_row):
            rows = dataset_of_row == d
            window_of_row[rows] = self._order.window_indices(int(d), number_of_row[rows])
        return list(zip(dataset_of_row.tolist(), window_of_row.tolist()))

    def batch(self, step: int, batch_size: int) -> Batch:
        """The batch for optimizer step `step` (0-based): tokens, segment_ids, loss_mask [B, L]."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        sources = self.sources(step, batch_size)
        out = _empty_batch(batch_size, self.seq_len)
        for d in sorted({d for d, _ in sources}):
            rows = [r for r, (dd, _) in enumerate(sources) if dd == d]
            packed = self._caches[d].windows([sources[r][1] for r in rows], self.seq_len)
            _fill_rows(out, rows, packed, self.loss_positions)
        return out


@dataclass(frozen=True)
class _Stage:
    start: int  # the sequence it starts at
    counts: np.ndarray  # sequences of each (active) dataset in each of its blocks
    base: np.ndarray  # sequences each dataset gave the stages before it


def staged_block_size(block_size: int, stage_starts: Sequence[int]) -> int:
    """The largest block size that divides `block_size` and every stage's first sequence, so
    that each stage starts on a block."""
    return functools.reduce(math.gcd, stage_starts, block_size)


def window_loss_mask(packed: Any, loss_positions: str | None) -> np.ndarray:
    """float32 [n, seq_len]: 1 where the loss counts position t (its prediction of t + 1).

    `same_document` (None): the cache reader's mask, positions whose next token is of their own
    document. `all`: every position but the last, Levanter's `LmExample.causal` mask, so the
    last token of a document (its EOS) also predicts the next document's first token. Either
    way a chat or supervised cache counts only predictions of its masked-in tokens.
    """
    if loss_positions in (None, "same_document"):
        return packed.loss_mask
    if loss_positions != "all":
        raise ValueError(f"loss_positions must be same_document or all, got {loss_positions!r}")
    mask = np.ones_like(packed.loss_mask)
    mask[:, -1] = 0
    if packed.assistant_masks is not None:  # a chat or supervised cache: its tokens alone
        mask[:, :-1] *= packed.assistant_masks[:, 1:]
    return mask


def fixed_batches(
    cache: WindowSource,
    seq_len: int,
    batch_size: int,
    num_batches: int,
    loss_positions: str | None = None,
) -> list[Batch]:
    """The first num_batches x batch_size windows of a cache (all if fewer), in order.

    Used for validation: the same windows at every evaluation and on every resume. The last batch
    is padded with all-zero rows whose loss_mask is 0, so every batch has the same shape (one
    compilation) and padding contributes nothing to a loss.
    """
    total = min(num_batches * batch_size, cache.num_windows(seq_len))
    if total < 1:
        name = cache.info.get("name", "?")
        raise MixtureError(
            f"validation set {name} has fewer tokens than one window of seq_len={seq_len}"
        )
    batches = []
    for start in range(0, total, batch_size):
        indices = list(range(start, min(start + batch_size, total)))
        out = _empty_batch(batch_size, seq_len)
        packed = cache.windows(indices, seq_len)
        _fill_rows(out, list(range(len(indices))), packed, loss_positions)
        batches.append(out)
    return batches


def _empty_batch(batch_size: int, seq_len: int) -> Batch:
    return {
        "tokens": np.zeros((batch_size, seq_len), np.int32),
        "segment_ids": np.zeros((batch_size, seq_len), np.int32),
        "loss_mask": np.zeros((batch_size, seq_len), np.float32),
    }


def _fill_rows(out: Batch, rows: list[int], packed: Any, loss_positions: str | None) -> None:
    out["tokens"][rows] = packed.tokens
    out["segment_ids"][rows] = packed.segment_ids
    out["loss_mask"][rows] = window_loss_mask(packed, loss_positions)
