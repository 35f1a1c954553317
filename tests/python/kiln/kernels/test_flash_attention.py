"""Pallas flash attention (interpret mode on CPU) against fp32 references, on fresh random inputs.

Each tensor (output, dQ, dK, dV) is compared with reference_attention in fp32 on the same
(dtype-rounded) inputs by two relative errors: ||kernel - ref|| / ||ref|| (norm) and
max |kernel - ref| / max |ref| (max, which catches a few wrong rows). Tolerances, also in
docs/attention-kernel.md, about 3x the worst seen over 60-100 seeds per case:
    fp32: norm 3e-5, max 1e-4   (fp32 end to end; outlier logits in the hundreds cost digits)
    bf16: norm 3e-2, max 1e-1   (bf16 output and bf16 operands of every dot, as on the GPU)
"""

from __future__ import annotations

import dataclasses
import os
import random
import subprocess
import sys
import textwrap
import warnings
import zlib
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.extend.core import ClosedJaxpr, Jaxpr, subjaxprs

from kiln.kernels import flash_attention_hopper
from kiln.kernels.flash_attention import (
    GENERIC_BLOCK_SIZES,
    TUNED_BLOCK_SIZES,
    BlockSizes,
    default_block_sizes,
    flash_attention,
)
from kiln.kernels.h200_export import export_for_h200
from kiln.kernels.reference import reference_attention

TOLERANCES = {  # dtype -> (norm, max) relative errors, for the output and every gradient
    jnp.float32: (3e-5, 1e-4),
    jnp.bfloat16: (3e-2, 1e-1),
}
SMALL_BLOCKS = BlockSizes(32, 32, 32, 32, 32, 32)
# Unequal tiles in every kernel exercise the causal loop-bound arithmetic.
MIXED_BLOCKS = BlockSizes(
    block_q=32, block_kv=64, block_q_dkv=64, block_kv_dkv=32, block_q_dq=32, block_kv_dq=64
)
# The Mosaic GPU kernels (GPU interpret mode on CPU): their tiles are multiples of 64.
HOPPER_BLOCKS = BlockSizes(hopper_forward=True, hopper_dkv=True, hopper_dq=True)


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


# Each case covers several features at once: the whole folder must stay well under a minute.
CASES = {
    "f32-d64-causal-gqa4:2-segments": Case(128, 4, 2, 64, jnp.float32, True, True, False),
    "f32-d128-full-gqa4:1-segments-outliers-pad100": Case(
        100, 4, 1, 128, jnp.float32, False, True, True, BlockSizes()
    ),
    "f32-d128-causal-segments-outliers-pad72": Case(72, 2, 2, 128, jnp.float32, True, True, True),
    "bf16-d128-causal-gqa4:2-segments-pad80": Case(80, 4, 2, 128, jnp.bfloat16, True, True, False),
    "bf16-d64-full-gqa4:1-outliers": Case(128, 4, 1, 64, jnp.bfloat16, False, False, True),
    "bf16-d64-causal-mixed-blocks-segments-pad200": Case(
        200, 2, 1, 64, jnp.bfloat16, True, True, True, MIXED_BLOCKS, batch=1
    ),
    # dQ accumulated by atomics in the dK/dV kernel (GQA: several q heads per kv program).
    "fused-dq-f32-d64-causal-gqa4:2-segments-mixed-blocks-pad100": Case(
        100, 4, 2, 64, jnp.float32, True, True, True, replace(MIXED_BLOCKS, fused_dq=True)
    ),
    "fused-dq-bf16-d128-full-gqa4:1-pad80": Case(
        80, 4, 1, 128, jnp.bfloat16, False, False, True, replace(SMALL_BLOCKS, fused_dq=True)
    ),
    # Several causal programs (the diagonal, skipped tiles, 3-deep rings) and ragged segments,
    # through the three Hopper kernels.
    "hopper-all-bf16-d64-causal-gqa4:2-segments-outliers-pad300": Case(
        300, 4, 2, 64, jnp.bfloat16, True, True, True,
        replace(HOPPER_BLOCKS, num_stages_fwd=3, num_stages_dkv=3, num_stages_dq=3), batch=1,
    ),
    # Unequal tiles, padded keys masked in the last kv tile only; padded query rows (segment -1)
    # then see no key at all.
    "hopper-fwd-bf16-d128-full-gqa4:1-segments-pad200": Case(
        200, 4, 1, 128, jnp.bfloat16, False, True, True,
        replace(HOPPER_BLOCKS, block_kv=128, hopper_dkv=False, hopper_dq=False), batch=1,
    ),
    # The Hopper backward after the Triton forward (whose lse is finite where the Hopper one's
    # is +inf), unequal tiles in both kernels; dQ's 256-row programs pad to 256, so the second
    # dK/dV program holds only padding.
    "hopper-bwd-bf16-d128-full-gqa4:2-segments-pad100": Case(
        100, 4, 2, 128, jnp.bfloat16, False, True, False,
        replace(
            HOPPER_BLOCKS, block_q=32, block_kv=32, hopper_forward=False, block_q_dkv=128,
            block_q_dq=128,
        ),
        batch=1,
    ),
    # FlashAttention-3's backward: the Hopper dK/dV kernel adds dQ by reduce-adds (read, add,
    # write back in the interpreter); the two warpgroups split dQ's columns, so both visit
    # every q tile of their program, masked ones included.
    "hopper-fused-dq-bf16-d128-causal-gqa4:2-segments-outliers-pad300": Case(
        300, 4, 2, 128, jnp.bfloat16, True, True, True,
        replace(HOPPER_BLOCKS, hopper_dq=False, fused_dq=True, num_stages_dkv=3), batch=1,
    ),
    # pT kept in fp32 through dsT (hopper_fused_fp32_probs), two batch rows.
    "hopper-fused-dq-fp32-probs-bf16-d128-full-pad100": Case(
        100, 2, 2, 128, jnp.bfloat16, False, False, False,
        replace(
            HOPPER_BLOCKS, hopper_forward=False, hopper_dq=False, fused_dq=True,
            hopper_fused_fp32_probs=True,
        ),
    ),
}


@pytest.fixture
def seed(request: pytest.FixtureRequest) -> int:
    """The test id's hash plus a fresh random offset: new inputs on every run. Failure messages
    print the seed; make_inputs(case, seed) reproduces the inputs."""
    return zlib.crc32(request.node.name.encode()) + random.randrange(2**20)


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
    segment_ids = ragged_segment_ids(rng, case.batch, case.seq_len) if case.segments else None
    cast = lambda x: jnp.asarray(x, case.dtype)  # noqa: E731
    return cast(q), cast(k), cast(v), segment_ids


def ragged_segment_ids(rng: np.random.Generator, batch: int, seq_len: int) -> jax.Array:
    """Packed documents of random lengths (1 token up to most of the row), different per row."""
    rows = []
    for _ in range(batch):
        starts = np.zeros(seq_len, np.int32)
        starts[rng.choice(np.arange(1, seq_len), size=rng.integers(1, 6), replace=False)] = 1
        starts[seq_len - 1] = 1  # A one-token document at the end.
        rows.append(np.cumsum(starts))
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


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_matches_reference(case: Case, seed: int) -> None:
    q, k, v, segment_ids = make_inputs(case, seed)
    d_out = jnp.asarray(np.random.default_rng(seed + 1).standard_normal(q.shape), case.dtype)

    ours = jax.jit(
        lambda *a: forward_and_grads(
            flash_attention, *a, causal=case.causal, block_sizes=case.block_sizes
        )
    )(q, k, v, segment_ids, d_out)
    # Jitted: op-by-op the reference costs more CPU time than compiling the kernel.
    expected = jax.jit(lambda *a: forward_and_grads(reference_attention, *a, causal=case.causal))(
        q, k, v, segment_ids, d_out
    )

    tolerances = TOLERANCES[case.dtype]
    for name, actual, want in zip(("out", "dq", "dk", "dv"), ours, expected):
        assert actual.dtype == case.dtype and actual.shape == want.shape, name
        errors = relative_errors(actual, want)
        assert all(e <= tol for e, tol in zip(errors, tolerances)), (
            f"{name}: (norm, max) relative errors {errors} > {tolerances} (seed={seed})"
        )


def test_matches_jax_pallas_mha(seed: int) -> None:
    """jax's own Pallas kernel as a second reference where features overlap (no GQA, no padding)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from jax.experimental.pallas.ops.gpu import attention as jax_attention

    case = Case(128, 2, 2, 64, jnp.float32, causal=True, segments=True, outliers=True)
    q, k, v, segment_ids = make_inputs(case, seed)
    d_out = jnp.asarray(np.random.default_rng(seed + 1).standard_normal(q.shape), jnp.float32)
    sm_scale = 0.125
    jax_blocks = jax_attention.BlockSizes(32, 32, 32, 32, 32, 32)

    def jax_mha(q, k, v, segment_ids):
        return jax_attention.mha(
            q, k, v, segment_ids, sm_scale, causal=True, block_sizes=jax_blocks, interpret=True
        )

    theirs = forward_and_grads(jax_mha, q, k, v, segment_ids, d_out)
    ours = forward_and_grads(
        flash_attention, q, k, v, segment_ids, d_out, sm_scale=sm_scale, block_sizes=SMALL_BLOCKS
    )
    for name, actual, want in zip(("out", "dq", "dk", "dv"), ours, theirs):
        errors = relative_errors(actual, want)
        assert all(e <= tol for e, tol in zip(errors, TOLERANCES[jnp.float32])), (
            f"{name}: (norm, max) relative errors {errors} vs jax mha (seed={seed})"
        )


def pallas_call_operand_shapes(closed: ClosedJaxpr) -> list[list[tuple[int, ...]]]:
    shapes = []

    def walk(jaxpr: Jaxpr) -> None:
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                shapes.append([tuple(var.aval.shape) for var in eqn.invars])
        for sub in subjaxprs(jaxpr):
            walk(sub)

    walk(closed.jaxpr)
    return shapes


def test_grouped_query_attention_never_repeats_kv() -> None:
    q = jnp.zeros((1, 64, 8, 64))
    kv = jnp.zeros((1, 64, 2, 64))

    def loss(q, k, v):
        return flash_attention(q, k, v, block_sizes=SMALL_BLOCKS).sum()

    calls = pallas_call_operand_shapes(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, kv, kv))
    assert len(calls) == 3, "expected forward, dK/dV and dQ kernels"
    for operands in calls:
        assert operands[1] == operands[2] == kv.shape, operands  # k, v keep their kv heads


HOPPER_FORWARD = {"hopper_forward": True, "block_q": 64, "block_kv": 128, "num_stages_fwd": 2}
HOPPER_BACKWARD = {
    "hopper_dkv": True,
    "block_q_dkv": 64,
    "block_kv_dkv": 64,
    "num_stages_dkv": 2,
    "hopper_dq": True,
    "block_q_dq": 64,
    "block_kv_dq": 128,
    "num_stages_dq": 2,
}


@pytest.mark.parametrize(
    "with_grad, layout",
    [
        (False, {}),
        (True, {}),
        (True, {"fused_dq": True}),
        # The GPU form of the Hopper kernels (operands from registers, in-place accumulators):
        # lowering is its check here.
        (True, HOPPER_FORWARD),
        (True, {**HOPPER_FORWARD, **HOPPER_BACKWARD}),
        # pT in fp32 here: the other form is compiled by test_hopper_compile.py.
        (
            True,
            {
                **HOPPER_FORWARD,
                **HOPPER_BACKWARD,
                "hopper_dq": False,
                "fused_dq": True,
                "hopper_fused_fp32_probs": True,
            },
        ),
    ],
    ids=[
        "forward",
        "forward+grad",
        "forward+grad-fused-dq",
        "forward+grad-hopper-forward",
        "forward+grad-hopper-all",
        "forward+grad-hopper-fused-dq-fp32-probs",
    ],
)
def test_lowers_for_h200(with_grad: bool, layout: dict) -> None:
    batch, seq_len, heads, kv_heads, dim = 2, 1000, 8, 2, 128  # 1000: exercises padding
    q = jax.ShapeDtypeStruct((batch, seq_len, heads, dim), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((batch, seq_len, kv_heads, dim), jnp.bfloat16)
    segment_ids = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32)
    blocks = replace(TUNED_BLOCK_SIZES["NVIDIA H200"][dim], **{"hopper_forward": False, **layout})

    def attention(q, k, v, segment_ids):
        return flash_attention(q, k, v, segment_ids, block_sizes=blocks)

    def loss(q, k, v, segment_ids):
        return attention(q, k, v, segment_ids).astype(jnp.float32).sum()

    fn = jax.grad(loss, argnums=(0, 1, 2)) if with_grad else attention
    exported = export_for_h200(fn, q, kv, kv, segment_ids)
    module = exported.mlir_module()
    triton = ["fwd", "dkv", "dq"] if with_grad else ["fwd"]
    mosaic = []
    switches = {"fused_dq": "dq", "hopper_forward": "fwd", "hopper_dkv": "dkv", "hopper_dq": "dq"}
    for kernel, replaced in switches.items():
        if getattr(blocks, kernel):
            triton.remove(replaced)
            if kernel == "hopper_dkv" and blocks.fused_dq:
                mosaic.append("bwd_hopper")  # dK, dV and dQ
            elif kernel != "fused_dq":
                mosaic.append(f"{replaced}_hopper")
    assert module.count("@__gpu$xla.gpu.triton(") == len(triton)
    assert module.count("@mosaic_gpu_v2(") == len(mosaic)
    for kernel in triton + mosaic:
        assert f"kiln_flash_attention_{kernel}" in module  # what profilers show
    assert exported.platforms == ("cuda",)


@pytest.mark.parametrize("sm_scale", [0.01, 8.0])
def test_hopper_forward_rows_that_start_on_fully_masked_tiles(sm_scale: float, seed: int) -> None:
    """Segments starting mid-tile: some rows see only masked keys in their first tile. At a
    small scale, a huge finite mask value broke the fused scale-and-subtract (inf, then NaN)."""
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.standard_normal((1, 256, 2, 64)), jnp.bfloat16) for _ in range(3))
    segment_ids = jnp.asarray(np.searchsorted([100, 200], np.arange(256), side="right")[None])
    ours = flash_attention(q, k, v, segment_ids, sm_scale=sm_scale, block_sizes=HOPPER_BLOCKS)
    f32 = (x.astype(jnp.float32) for x in (q, k, v))
    expected = reference_attention(*f32, segment_ids, sm_scale=sm_scale)
    errors = relative_errors(ours, expected)
    assert all(e <= tol for e, tol in zip(errors, TOLERANCES[jnp.bfloat16])), (errors, seed)


@pytest.fixture
def race_detector(monkeypatch, capsys):
    """GPU interpret mode with jax's happens-before race detector; yields a function that says
    whether it reported a race (it prints "RACE DETECTED" and goes on). Caches are cleared both
    ways: a kernel traced before would keep the settings it was traced with."""
    params = plgpu.InterpretGPUParams(detect_races=True)
    monkeypatch.setattr(flash_attention_hopper, "INTERPRET_PARAMS", params)
    jax.clear_caches()
    yield lambda: "RACE DETECTED" in capsys.readouterr().out
    jax.clear_caches()


# Small: the detector keeps a vector clock per access. Several tiles per program, 3-deep rings.
# The fused backward in one program (128 rows): between programs, the interpreter's stand-in for
# the reduce-add (read, add, write back; right because it runs programs one at a time) is a race
# on a GPU, and the detector reports it, though the GPU's reduce-add is atomic.
RACE_CASES = {
    "hopper-all-d64": Case(
        192, 2, 1, 64, jnp.bfloat16, True, True, False,
        replace(HOPPER_BLOCKS, num_stages_fwd=3, num_stages_dkv=3, num_stages_dq=3), batch=1,
    ),
    "hopper-fused-dq-d128": Case(
        128, 4, 1, 128, jnp.bfloat16, False, True, False,
        replace(HOPPER_BLOCKS, hopper_dq=False, fused_dq=True, num_stages_dkv=3), batch=1,
    ),
}


@pytest.mark.parametrize("case", RACE_CASES.values(), ids=RACE_CASES.keys())
def test_hopper_kernels_fence_and_wait_for_their_shared_memory(case, seed, race_detector) -> None:
    """Every Hopper kernel (the forward, dK/dV, dQ, and the fused backward) under the race
    detector: a warpgroup's SMEM stores that TMA then reads (outputs, the fused dQ's staging)
    need a commit_smem fence, and the tiles TMA writes need a barrier wait before the loads. On
    CPU copies run eagerly, so the results are right without either: only the detector sees a
    missing one. (It does not yet track the reads of wgmma operands.)"""
    q, k, v, segment_ids = make_inputs(case, seed)
    d_out = jnp.ones_like(q)
    jax.block_until_ready(
        forward_and_grads(
            flash_attention, q, k, v, segment_ids, d_out, block_sizes=case.block_sizes
        )
    )
    assert not race_detector(), f"the race detector's report is above (seed={seed})"


@pytest.mark.parametrize("fence", [True, False])
def test_the_race_detector_sees_a_missing_fence(fence: bool, race_detector) -> None:
    """What the test above relies on, in this jax: SMEM written by a warpgroup and read by TMA
    without commit_smem is reported; with it, not. The copied values are right either way."""

    def body(x_ref, out_ref, smem):
        smem[...] = x_ref[...] + 1.0
        if fence:
            plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(smem, out_ref)
        plgpu.wait_smem_to_gmem(0)

    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((128,), jnp.float32),
        scratch_types=[plgpu.SMEM((128,), jnp.float32)],
        interpret=flash_attention_hopper.INTERPRET_PARAMS,
    )
    np.testing.assert_array_equal(kernel(jnp.zeros(128, jnp.float32)), np.ones(128))
    assert race_detector() is not fence


def test_hopper_interpreter_refuses_a_thread_pool_it_would_hang_on(monkeypatch) -> None:
    """Fewer XLA CPU threads than warpgroups hang the interpreter at a barrier: a clear error
    instead (the check reads the environment the pool was sized from)."""
    monkeypatch.setenv("PJRT_NPROC", "2")
    x = jnp.zeros((1, 128, 1, 64), jnp.bfloat16)
    with pytest.raises(RuntimeError, match="3 warpgroups.*Set PJRT_NPROC=4"):
        flash_attention(x, x, x, block_sizes=replace(HOPPER_BLOCKS, block_kv=128))


def test_hopper_interpreter_refuses_several_devices() -> None:
    """jax's GPU interpreter keeps one process-wide SMEM and barrier state: under a shard_map over
    two CPU devices the Hopper kernels failed deep inside it ("Barrier remains allocated"). A
    clear error instead; a fresh process, since the device count is fixed when jax starts."""
    script = textwrap.dedent(
        """
        import jax, jax.numpy as jnp, numpy as np
        from jax.sharding import Mesh, PartitionSpec
        from kiln.kernels.flash_attention import BlockSizes, flash_attention

        blocks = BlockSizes(hopper_forward=True, block_kv=128)
        x = jnp.zeros((2, 128, 1, 64), jnp.bfloat16)
        spec = PartitionSpec("data")
        jax.shard_map(
            lambda q, k, v: flash_attention(q, k, v, block_sizes=blocks),
            mesh=Mesh(np.array(jax.devices()), ("data",)),
            in_specs=(spec,) * 3,
            out_specs=spec,
        )(x, x, x)
        """
    )
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
        "PYTHONPATH": os.pathsep.join(sys.path),
    }
    run = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode != 0, run.stdout
    assert "GPU interpret mode over 2 devices" in run.stderr, run.stderr[-3000:]


def test_hopper_kernels_refuse_a_device_that_is_not_hopper() -> None:
    """Compiled (not interpreted) for this CPU, the Mosaic GPU kernels would fail deep in
    lowering: a clear error first, naming the switches."""
    x = jnp.zeros((1, 128, 2, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"hopper_forward, hopper_dkv, hopper_dq run Mosaic GPU"):
        flash_attention(x, x, x, block_sizes=HOPPER_BLOCKS, interpret=False)


def test_hopper_fused_dq_refuses_head_dim_64() -> None:
    """Each warpgroup takes half of dQ's columns, a slice of K's 64-wide SMEM tiling."""
    x = jnp.zeros((1, 128, 2, 64), jnp.bfloat16)
    blocks = replace(HOPPER_BLOCKS, hopper_dq=False, fused_dq=True)

    def loss(q, k, v):
        return flash_attention(q, k, v, block_sizes=blocks).astype(jnp.float32).sum()

    with pytest.raises(ValueError, match="head dim a multiple of 128, got 64"):
        jax.grad(loss)(x, x, x)


def test_hopper_kernels_take_16_bit_inputs_only() -> None:
    """fp32 inputs keep the Triton kernels even where the table turns the Hopper ones on."""
    blocks = replace(
        TUNED_BLOCK_SIZES["NVIDIA H200"][64], hopper_forward=True, hopper_dkv=True, hopper_dq=True
    )

    def loss(q, k, v):
        return flash_attention(q, k, v, block_sizes=blocks).astype(jnp.float32).sum()

    for dtype, mosaic_calls in ((jnp.bfloat16, 3), (jnp.float16, 3), (jnp.float32, 0)):
        x = jax.ShapeDtypeStruct((1, 256, 2, 64), dtype)
        module = export_for_h200(jax.grad(loss, argnums=(0, 1, 2)), x, x, x).mlir_module()
        assert module.count("@mosaic_gpu_v2(") == mosaic_calls, dtype


def test_default_block_sizes_by_device_kind() -> None:
    assert default_block_sizes("NVIDIA H200", 128) is TUNED_BLOCK_SIZES["NVIDIA H200"][128]
    assert default_block_sizes("cpu", 64) is GENERIC_BLOCK_SIZES[64]
    assert default_block_sizes("some new GPU", 256) is GENERIC_BLOCK_SIZES[128]


@pytest.mark.parametrize(
    "shapes, message",
    [
        (((1, 64, 4, 64), (1, 64, 3, 64), None), "multiple of kv heads"),
        (((1, 64, 2, 48), (1, 64, 2, 48), None), "power of two"),
        (((1, 64, 2, 64), (1, 32, 2, 64), None), "share batch, seq"),
        (((1, 64, 2, 64), (1, 64, 2, 64), (1, 32)), "segment_ids"),
    ],
)
def test_rejects_bad_inputs(shapes, message: str) -> None:
    q_shape, kv_shape, segment_shape = shapes
    q, kv = jnp.zeros(q_shape), jnp.zeros(kv_shape)
    segment_ids = None if segment_shape is None else jnp.zeros(segment_shape, jnp.int32)
    with pytest.raises(ValueError, match=message):
        flash_attention(q, kv, kv, segment_ids)


def test_rejects_bad_block_size() -> None:
    with pytest.raises(ValueError, match="block_kv=48"):
        BlockSizes(block_kv=48)
    with pytest.raises(ValueError, match=r"block_q=32 must be a power of two >= 64 \(a Hopper"):
        BlockSizes(block_q=32, hopper_forward=True)
    with pytest.raises(ValueError, match="num_stages_fwd"):
        BlockSizes(num_stages_fwd=1, hopper_forward=True)
    with pytest.raises(ValueError, match=r"block_kv_dq=32 must be a power of two >= 64 \(a Hopper"):
        BlockSizes(block_kv_dq=32, hopper_dq=True)
    with pytest.raises(ValueError, match="hopper_dq and fused_dq"):
        BlockSizes(hopper_dq=True, fused_dq=True)
    with pytest.raises(ValueError, match="hopper_fused_fp32_probs .* set hopper_dkv and fused_dq"):
        BlockSizes(hopper_fused_fp32_probs=True, fused_dq=True)
