"""Levanter's order of training windows, for `data_order="levanter"` (docs/training.md).

What `levanter.main.train_lm` reads with its data defaults (marin-levanter 0.2.227, checked window
by window against its own `LmDataConfig.train_mixture` in test_levanter_order.py):

- keys: data = split(PRNGKey(seed), 4)[0]; mix, shuffle = split(data); the c-th dataset with a
  weight gets the c-th key of `key_iterator(shuffle)`; jax's threefry, partitionable;
- each dataset's windows are block-shuffled once (`BlockShufflingDataset`): blocks of 256
  windows in a Feistel order, the windows of each group of 512 blocks in a Feistel order of
  their own, the partial last block shuffled within itself; every epoch reads this same order;
- the mixture cuts the sequence stream into blocks of 2048 holding trunc(share x 2048) sequences
  of each dataset (the remainder to the largest), in the order `jax.random.permutation(
  fold_in(mix, block))`; a dataset's k-th sequence is its shuffled window k mod N.

The Feistel network is Levanter's (`levanter.data._prp`): 5 rounds of a multiplicative round
function, keyed by a numpy PCG64 seeded from `jax.random.randint(key, (), 0, 2**30)`.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence

import jax
import numpy as np

IO_BLOCK_SIZE = 256  # DEFAULT_LM_DATA_SHUFFLE
WINDOW_BLOCKS = 512
FEISTEL_ROUNDS = 5
_ROUND_MULTIPLIER = np.uint64(2654435761)
_ID_BITS = 16  # a mixture id is (dataset << 16) + its rank in the block


@contextlib.contextmanager
def _levanter_random() -> Iterator[None]:
    """Keys are tiny: made on the CPU, by the threefry Levanter configures (partitionable)."""
    with jax.default_device(jax.devices("cpu")[0]), jax.threefry_partitionable(True):
        yield


def levanter_keys(seed: int, datasets: int) -> tuple[jax.Array, list[jax.Array]]:
    """The mixture's key and each dataset's shuffle key, as train_lm derives them."""
    with _levanter_random():
        data_key = jax.random.split(jax.random.PRNGKey(seed), 4)[0]
        mix_key, key = jax.random.split(data_key)
        dataset_keys = []
        for _ in range(datasets):  # levanter.utils.jax_utils.key_iterator
            key, subkey = jax.random.split(key)
            dataset_keys.append(subkey)
    return mix_key, dataset_keys


def _pcg_seed(key: jax.Array) -> int:
    with _levanter_random():
        return int(jax.random.randint(key, (), 0, 2**30))


def _fold_in(key: jax.Array, data: int) -> jax.Array:
    with _levanter_random():
        return jax.random.fold_in(key, data)


def _split3(key: jax.Array) -> list[jax.Array]:
    with _levanter_random():
        return list(jax.random.split(key, 3))


def _permuted(key: jax.Array, values: np.ndarray) -> np.ndarray:
    with _levanter_random():
        return np.asarray(jax.random.permutation(key, values.astype(np.int32)))


class LevanterFeistel:
    """Levanter's FeistelPermutation of [0, length): a Feistel network on the next power of two,
    cycle-walked back into range."""

    def __init__(self, length: int, key: jax.Array):
        self.length = length
        bits = (length - 1).bit_length()  # of the next power of two's domain
        self.right_bits = np.uint64(bits - bits // 2)
        self.mask = np.uint64((1 << int(self.right_bits)) - 1)
        rng = np.random.Generator(np.random.PCG64(_pcg_seed(key)))
        self.keys = rng.integers(0, 1 << int(self.right_bits), size=FEISTEL_ROUNDS, dtype=np.uint64)

    def _network(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self.right_bits, x & self.mask
        for key in self.keys:
            left, right = right, left ^ (((right & self.mask) * _ROUND_MULTIPLIER + key) & self.mask)
        return (left << self.right_bits) | right

    def __call__(self, indices: np.ndarray) -> np.ndarray:
        if self.length == 1:
            return np.zeros_like(indices)
        x = self._network(np.asarray(indices, dtype=np.uint64))
        outside = x >= self.length
        while outside.any():
            x[outside] = self._network(x[outside])
            outside = x >= self.length
        return x.astype(np.int64)


class BlockShuffle:
    """Levanter's BlockShufflingDataset index map for a dataset of `length` windows."""

    def __init__(self, length: int, key: jax.Array):
        block_key, self._full_key, self._tail_key = _split3(key)
        self.full_blocks, self.tail = divmod(length, IO_BLOCK_SIZE)
        self.total_blocks = self.full_blocks + int(self.tail > 0)
        self.groups = -(-self.total_blocks // WINDOW_BLOCKS)
        self._block_order = (
            LevanterFeistel(self.full_blocks, block_key) if self.full_blocks > 1 else None
        )
        self._group_orders = functools.lru_cache(maxsize=4)(self._group_order)

    def _group_order(self, group: int) -> tuple[np.ndarray, LevanterFeistel | None, LevanterFeistel | None]:
        """The physical blocks of a group of blocks, and the orders of its full and tail regions."""
        first = group * WINDOW_BLOCKS
        blocks = min(WINDOW_BLOCKS, self.total_blocks - first)
        has_tail = self.tail > 0 and first + blocks == self.total_blocks
        positions = np.arange(first, first + blocks - int(has_tail), dtype=np.int64)
        physical = self._block_order(positions) if self._block_order else positions
        full_size = len(positions) * IO_BLOCK_SIZE
        full = LevanterFeistel(full_size, _fold_in(self._full_key, group)) if full_size > 1 else None
        tail_size = self.tail if has_tail else 0
        tail = LevanterFeistel(tail_size, _fold_in(self._tail_key, group)) if tail_size > 1 else None
        return physical, full, tail

    def __call__(self, indices: np.ndarray) -> np.ndarray:
        group_size = IO_BLOCK_SIZE * WINDOW_BLOCKS
        groups = np.minimum(indices // group_size, self.groups - 1)
        offsets = indices - groups * group_size
        windows = np.empty_like(indices)
        for group in np.unique(groups):
            physical, full, tail = self._group_orders(int(group))
            rows = np.flatnonzero(groups == group)
            in_full = offsets[rows] < len(physical) * IO_BLOCK_SIZE
            full_rows, tail_rows = rows[in_full], rows[~in_full]
            permuted = full(offsets[full_rows]) if full else offsets[full_rows]
            block, within = np.divmod(permuted, IO_BLOCK_SIZE)
            windows[full_rows] = physical[block] * IO_BLOCK_SIZE + within
            tail_offsets = offsets[tail_rows] - len(physical) * IO_BLOCK_SIZE
            permuted_tail = tail(tail_offsets) if tail else tail_offsets
            windows[tail_rows] = self.full_blocks * IO_BLOCK_SIZE + permuted_tail
        return windows


class LevanterOrder:
    """The `kiln.data.mixture.WindowOrder` of Levanter: its block counts, its block order and its
    shuffle of each dataset, the same every epoch."""

    def __init__(self, num_windows: Sequence[int], seed: int):
        self._mix_key, keys = levanter_keys(seed, len(num_windows))
        self._num_windows = list(num_windows)
        self._shuffles = [BlockShuffle(n, key) for n, key in zip(num_windows, keys)]

    @staticmethod
    def block_counts(weights: Sequence[float], block_size: int) -> np.ndarray:
        """trunc(share x block_size) each, the remainder to the first largest (MixtureDataset)."""
        total = sum(weights)
        counts = np.array([int(w / total * block_size) for w in weights], dtype=np.int64)
        counts[int(np.argmax(counts))] += block_size - int(counts.sum())
        return counts

    def block_layout(self, block: int, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        ids = np.concatenate([(d << _ID_BITS) + np.arange(n) for d, n in enumerate(counts)])
        permuted = _permuted(_fold_in(self._mix_key, block), ids).astype(np.int64)
        return permuted >> _ID_BITS, permuted & ((1 << _ID_BITS) - 1)

    def window_indices(self, d: int, sequence_numbers: np.ndarray) -> np.ndarray:
        return self._shuffles[d](sequence_numbers % self._num_windows[d])
