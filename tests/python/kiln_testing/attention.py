"""Helpers for the attention kernels' tests: cases, random inputs, the reference comparison.

Each tensor (output, dQ, dK, dV) is compared with reference_attention in fp32 on the same
(dtype-rounded) inputs by two relative errors: ||kernel - ref|| / ||ref|| (norm) and
max |kernel - ref| / max |ref| (max, which catches a few wrong rows). Tolerances, also in
docs/attention-kernel.md, about 3x the worst seen over 60-100 seeds per case:
    fp32: norm 3e-5, max 1e-4   (fp32 end to end; outlier logits in the hundreds cost digits)
    bf16: norm 3e-2, max 1e-1   (bf16 output and bf16 operands of every dot, as on the GPU;
                                 norm 6e-2 for the Mosaic lowering: MOSAIC_TOLERANCES)
"""

from __future__ import annotations

import dataclasses
import random
import zlib
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from kiln.kernels.block_sizes import BlockSizes, LaunchParams
from kiln.kernels.reference import reference_attention

TOLERANCES = {  # dtype -> (norm, max) relative errors, for the output and every gradient
    jnp.float32: (3e-5, 1e-4),
    jnp.bfloat16: (3e-2, 1e-1),
}
# The Mosaic lowering takes q pre-scaled by sm_scale * log2(e) in q's dtype (as splash's callers
# do): one more bf16 rounding of q, which outlier logits turn into ~2x the Triton path's dK error
# (worst 2.2e-2 norm over 40 seeds).
MOSAIC_TOLERANCES = {**TOLERANCES, jnp.bfloat16: (6e-2, 1e-1)}
SMALL_BLOCKS = BlockSizes(32, 32, 32, 32, 32, 32)


@dataclasses.dataclass(frozen=True)
class Case:
    seq_len: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: type
    causal: bool
    segments: bool
    outliers: bool
    block_sizes: BlockSizes = SMALL_BLOCKS
    batch: int = 2
    launch: LaunchParams = LaunchParams()
    max_documents: int = 6  # boundaries per row, with segments: 1 to max_documents - 1 random
    # Segment ids drawn from a few values per run of tokens instead of counting up, so that
    # equal ids recur in runs far apart (the kernel takes any ids, not only numbered documents).
    relabelled: bool = False
    lowering: str = "triton"  # "mosaic": the TPU kernels, in TPU interpret mode


def fresh_seed(test_name: str) -> int:
    """The test id's hash plus a fresh random offset: new inputs on every run. Failure messages
    print the seed; make_inputs(case, seed) reproduces the inputs."""
    return zlib.crc32(test_name.encode()) + random.randrange(2**20)


def make_inputs(case: Case, seed: int):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((case.batch, case.seq_len, case.num_heads, case.head_dim))
    k = rng.standard_normal((case.batch, case.seq_len, case.num_kv_heads, case.head_dim))
    v = rng.standard_normal(k.shape)
    if case.outliers:
        # A few huge logits: the online softmax's running max must absorb them without overflow.
        for x in (q, k):
            rows = rng.integers(0, case.seq_len, size=3)
            x[:, rows] *= 8.0
    segment_ids = None
    if case.segments:
        segment_ids = ragged_segment_ids(
            rng, case.batch, case.seq_len, case.max_documents, relabelled=case.relabelled
        )
    cast = lambda x: jnp.asarray(x, case.dtype)  # noqa: E731
    return cast(q), cast(k), cast(v), segment_ids


def ragged_segment_ids(
    rng: np.random.Generator,
    batch: int,
    seq_len: int,
    max_documents: int = 6,
    *,
    relabelled: bool = False,
) -> jax.Array:
    """Packed documents of random lengths (1 token up to most of the row), different per row: 1 to
    max_documents - 1 random boundaries, and a one-token document at the end. relabelled: each
    run of tokens gets one of 3 ids at random instead of its number."""
    rows = []
    for _ in range(batch):
        starts = np.zeros(seq_len, np.int32)
        boundaries = rng.integers(1, max_documents)
        starts[rng.choice(np.arange(1, seq_len), size=boundaries, replace=False)] = 1
        starts[seq_len - 1] = 1  # A one-token document at the end.
        runs = np.cumsum(starts)
        rows.append(rng.integers(0, 3, runs.max() + 1)[runs] if relabelled else runs)
    return jnp.asarray(np.stack(rows), jnp.int32)


def relative_errors(actual: jax.Array, expected: jax.Array) -> tuple[float, float]:
    """(norm, max) relative errors of `actual` against `expected`."""
    actual, expected = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
    assert np.all(np.isfinite(actual)), "non-finite values in kernel result"
    difference = actual - expected
    return (
        float(np.linalg.norm(difference) / np.linalg.norm(expected)),
        float(np.max(np.abs(difference)) / np.max(np.abs(expected))),
    )


def forward_and_grads(attention, q, k, v, segment_ids, d_out, **kwargs):
    out, vjp = jax.vjp(lambda q, k, v: attention(q, k, v, segment_ids, **kwargs), q, k, v)
    return (out, *vjp(d_out))


def check_against_reference(attention: Callable, case: Case, seed: int) -> None:
    """attention(q, k, v, segment_ids, causal=, block_sizes=, launch=, lowering=)'s output and
    gradients (a random cotangent) against reference_attention's, within TOLERANCES."""
    q, k, v, segment_ids = make_inputs(case, seed)
    d_out = jnp.asarray(np.random.default_rng(seed + 1).standard_normal(q.shape), case.dtype)
    settings = {"causal": case.causal, "block_sizes": case.block_sizes, "launch": case.launch}
    if case.lowering != "triton":  # the lab's kernels take the Triton lowering's arguments only
        settings["lowering"] = case.lowering
    ours = jax.jit(lambda *a: forward_and_grads(attention, *a, **settings))(
        q, k, v, segment_ids, d_out
    )
    # Jitted: op-by-op the reference costs more CPU time than compiling the kernel.
    expected = jax.jit(lambda *a: forward_and_grads(reference_attention, *a, causal=case.causal))(
        q, k, v, segment_ids, d_out
    )
    tolerances = (MOSAIC_TOLERANCES if case.lowering == "mosaic" else TOLERANCES)[case.dtype]
    for name, actual, want in zip(("out", "dq", "dk", "dv"), ours, expected):
        assert actual.dtype == case.dtype and actual.shape == want.shape, name
        errors = relative_errors(actual, want)
        assert all(e <= tol for e, tol in zip(errors, tolerances)), (
            f"{name}: (norm, max) relative errors {errors} > {tolerances} (seed={seed})"
        )
