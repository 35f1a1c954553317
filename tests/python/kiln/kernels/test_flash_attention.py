"""Pallas flash attention (interpret mode on CPU) against fp32 references, on fresh random inputs.

kiln_testing.attention has the cases' helpers and the tolerances (also in
docs/attention-kernel.md).
"""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import ClosedJaxpr, Jaxpr, subjaxprs
from kiln_testing.attention import (
    SMALL_BLOCKS,
    TOLERANCES,
    Case,
    check_against_reference,
    forward_and_grads,
    fresh_seed,
    make_inputs,
    relative_errors,
)

from kiln.kernels.block_sizes import (
    GENERIC_BLOCK_SIZES,
    GENERIC_MOSAIC_BLOCK_SIZES,
    TUNED_BLOCK_SIZES,
    BlockSizes,
    LaunchParams,
    default_block_sizes,
)
from kiln.kernels.device_export import TPU_V5E, export_for_device, export_for_h200
from kiln.kernels.flash_attention import flash_attention
from kiln.kernels.reference import reference_attention

# Unequal tiles in every kernel exercise the causal loop-bound arithmetic.
MIXED_BLOCKS = BlockSizes(
    block_q=32, block_kv=64, block_q_dkv=64, block_kv_dkv=32, block_q_dq=32, block_kv_dq=64
)
FUSED_DQ = LaunchParams(fused_dq=True)
# The TPU kernels' tiles are whole 128-lane rows; unequal tiles, and kv tiles whose products
# take half a tile (splash's compute blocks), exercise the schedule and the chunk skipping.
MOSAIC_BLOCKS = BlockSizes(
    block_q=128, block_kv=256, block_q_dkv=128, block_kv_dkv=256, block_q_dq=256,
    block_kv_dq=128, block_kv_compute=128, block_kv_dkv_compute=128,
)  # fmt: skip
MOSAIC_TILES = BlockSizes(*[128] * 6)

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
        100, 4, 2, 64, jnp.float32, True, True, True, MIXED_BLOCKS, launch=FUSED_DQ
    ),
    "fused-dq-bf16-d128-full-gqa4:1-pad80": Case(
        80, 4, 1, 128, jnp.bfloat16, False, False, True, SMALL_BLOCKS, launch=FUSED_DQ
    ),
    # Many short documents: most tile pairs lie across document boundaries and are skipped.
    "f32-d64-causal-gqa4:2-many-documents": Case(
        256, 4, 2, 64, jnp.float32, True, True, False, max_documents=40
    ),
    "bf16-d128-full-many-documents-pad200": Case(
        200, 2, 1, 128, jnp.bfloat16, False, True, True, max_documents=30, batch=1
    ),
    "fused-dq-f32-d64-full-gqa4:2-many-documents-mixed-blocks": Case(
        192, 4, 2, 64, jnp.float32, False, True, False, MIXED_BLOCKS, launch=FUSED_DQ,
        max_documents=30, batch=1,
    ),  # fmt: skip
    # Equal ids in runs far apart attend to each other: skipping compares id ranges, not order.
    "f32-d64-causal-relabelled-segments": Case(
        128, 2, 1, 64, jnp.float32, True, True, False, max_documents=12, relabelled=True
    ),
    # The Mosaic (TPU) lowering, in TPU interpret mode.
    "mosaic-f32-d128-causal-gqa4:2-segments-outliers-pad300": Case(
        300, 4, 2, 128, jnp.float32, True, True, True, MOSAIC_BLOCKS, lowering="mosaic"
    ),
    "mosaic-bf16-d64-full-gqa4:1-many-documents-pad200": Case(
        200, 4, 1, 64, jnp.bfloat16, False, True, False, MOSAIC_BLOCKS, max_documents=30,
        lowering="mosaic",
    ),  # fmt: skip
    "mosaic-bf16-d128-causal-no-segments-outliers": Case(
        256, 2, 2, 128, jnp.bfloat16, True, False, True, MOSAIC_TILES, batch=1, lowering="mosaic"
    ),
    # dQ written per kv tile by the dK/dV kernel and summed (GQA: the group's heads in turn).
    "mosaic-fused-dq-f32-d128-causal-gqa4:2-segments-mixed-blocks-pad300": Case(
        300, 4, 2, 128, jnp.float32, True, True, False, MOSAIC_BLOCKS, launch=FUSED_DQ,
        lowering="mosaic",
    ),  # fmt: skip
    "mosaic-fused-dq-bf16-d64-full-many-documents-pad200": Case(
        200, 2, 1, 64, jnp.bfloat16, False, True, True, MOSAIC_TILES, launch=FUSED_DQ,
        max_documents=30, batch=1, lowering="mosaic",
    ),  # fmt: skip
    "mosaic-f32-d64-causal-relabelled-segments": Case(
        384, 2, 1, 64, jnp.float32, True, True, False, MOSAIC_TILES, batch=1, max_documents=12,
        relabelled=True, lowering="mosaic",
    ),  # fmt: skip
}


@pytest.fixture
def seed(request: pytest.FixtureRequest) -> int:
    return fresh_seed(request.node.name)


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_matches_reference(case: Case, seed: int) -> None:
    check_against_reference(flash_attention, case, seed)


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


KERNEL_SETTINGS = {  # lowering, its tiles, its launch parameters
    "triton-split-dq": ("triton", SMALL_BLOCKS, LaunchParams()),
    "triton-fused-dq": ("triton", SMALL_BLOCKS, FUSED_DQ),
    "mosaic-split-dq": ("mosaic", MOSAIC_TILES, LaunchParams()),
    "mosaic-fused-dq": ("mosaic", MOSAIC_TILES, FUSED_DQ),
}


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("settings", KERNEL_SETTINGS.values(), ids=KERNEL_SETTINGS.keys())
def test_tiles_of_other_documents_are_never_read(causal: bool, settings, seed: int):
    """Each row holds document B (three tiles) then document A (the last tile). B's values
    and output cotangents are NaN. A pair of tiles across documents is skipped, so A's output
    and gradients are finite and equal attention over A alone; were one such pair visited, its
    masked probabilities (0) times B's NaN would reach them, in every kernel."""
    lowering, blocks, launch = settings
    tile = blocks.block_q
    case = Case(4 * tile, 4, 2, 64, jnp.float32, causal, segments=False, outliers=False, batch=1)
    q, k, v, _ = make_inputs(case, seed)
    d_out = jnp.asarray(np.random.default_rng(seed + 1).standard_normal(q.shape), jnp.float32)
    a = slice(3 * tile, 4 * tile)
    segment_ids = jnp.asarray([[0] * 3 * tile + [1] * tile] * case.batch, jnp.int32)
    v, d_out = v.at[:, : 3 * tile].set(jnp.nan), d_out.at[:, : 3 * tile].set(jnp.nan)
    ours = forward_and_grads(
        flash_attention, q, k, v, segment_ids, d_out, causal=causal, block_sizes=blocks,
        launch=launch, lowering=lowering,
    )  # fmt: skip
    alone = forward_and_grads(
        reference_attention, q[:, a], k[:, a], v[:, a], None, d_out[:, a], causal=causal
    )
    for name, actual, want in zip(("out", "dq", "dk", "dv"), ours, alone):
        errors = relative_errors(actual[:, a], want)
        assert all(e <= tol for e, tol in zip(errors, TOLERANCES[jnp.float32])), (
            f"{name}: (norm, max) relative errors {errors} (seed={seed})"
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


@pytest.mark.parametrize("lowering", ["triton", "mosaic"])
def test_grouped_query_attention_never_repeats_kv(lowering: str) -> None:
    q = jnp.zeros((1, 128, 8, 64))
    kv = jnp.zeros((1, 128, 2, 64))
    blocks = MOSAIC_TILES if lowering == "mosaic" else SMALL_BLOCKS
    # K and V as the kernels take them: [batch, seq, kv heads, dim], or head-major on TPUs.
    kv_shape = kv.shape if lowering == "triton" else (1, 2, 128, 64)

    def loss(q, k, v):
        return flash_attention(q, k, v, block_sizes=blocks, lowering=lowering).sum()

    calls = pallas_call_operand_shapes(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, kv, kv))
    assert len(calls) == 3, "expected forward, dK/dV and dQ kernels"
    for operands in calls:
        assert operands.count(kv_shape) == 2, operands  # k and v keep their kv heads


@pytest.mark.parametrize(
    "with_grad, fused_dq",
    [(False, False), (True, False), (True, True)],
    ids=["forward", "forward+grad", "forward+grad-fused-dq"],
)
def test_lowers_for_h200(with_grad: bool, fused_dq: bool) -> None:
    batch, seq_len, heads, kv_heads, dim = 2, 1000, 8, 2, 128  # 1000: exercises padding
    q = jax.ShapeDtypeStruct((batch, seq_len, heads, dim), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((batch, seq_len, kv_heads, dim), jnp.bfloat16)
    segment_ids = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32)
    blocks, launch = TUNED_BLOCK_SIZES["NVIDIA H200"][dim]
    launch = dataclasses.replace(launch, fused_dq=fused_dq)

    def attention(q, k, v, segment_ids):
        return flash_attention(q, k, v, segment_ids, block_sizes=blocks, launch=launch)

    def loss(q, k, v, segment_ids):
        return attention(q, k, v, segment_ids).astype(jnp.float32).sum()

    fn = jax.grad(loss, argnums=(0, 1, 2)) if with_grad else attention
    exported = export_for_h200(fn, q, kv, kv, segment_ids)
    module = exported.mlir_module()
    kernels = ["fwd", "dkv", "dq"] if with_grad else ["fwd"]
    if fused_dq:
        kernels.remove("dq")  # dQ comes from the dK/dV kernel
    assert module.count("@__gpu$xla.gpu.triton(") == len(kernels)
    for kernel in kernels:
        assert f"kiln_flash_attention_{kernel}" in module  # what profilers show
    assert exported.platforms == ("cuda",)


@pytest.mark.parametrize(
    "with_grad, fused_dq",
    [(False, False), (True, False), (True, True)],
    ids=["forward", "forward+grad", "forward+grad-fused-dq"],
)
def test_lowers_for_tpu_v5e(with_grad: bool, fused_dq: bool) -> None:
    """jax.export for a TPU v5e from this machine: the Mosaic kernels lower (Pallas to Mosaic
    MLIR, with the v5e's table entry); nothing compiles or runs."""
    batch, seq_len, heads, kv_heads, dim = 2, 1000, 8, 2, 128  # 1000: exercises padding
    q = jax.ShapeDtypeStruct((batch, seq_len, heads, dim), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((batch, seq_len, kv_heads, dim), jnp.bfloat16)
    segment_ids = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32)

    launch = LaunchParams(fused_dq=fused_dq)

    def attention(q, k, v, segment_ids):
        return flash_attention(q, k, v, segment_ids, launch=launch)

    def loss(q, k, v, segment_ids):
        return attention(q, k, v, segment_ids).astype(jnp.float32).sum()

    fn = jax.grad(loss, argnums=(0, 1, 2)) if with_grad else attention
    exported = export_for_device(TPU_V5E, fn, q, kv, kv, segment_ids)
    module = exported.mlir_module()
    kernels = ["fwd", "dkv", "dq"] if with_grad else ["fwd"]
    if fused_dq:
        kernels.remove("dq")  # dQ comes from the dK/dV kernel
    assert module.count("tpu_custom_call") == len(kernels)
    for kernel in kernels:
        assert f"kiln_flash_attention_{kernel}" in module
    assert exported.platforms == ("tpu",)


def test_default_block_sizes_by_device_kind() -> None:
    assert default_block_sizes("NVIDIA H200", 128) is TUNED_BLOCK_SIZES["NVIDIA H200"][128]
    assert default_block_sizes("cpu", 64) is GENERIC_BLOCK_SIZES[64]
    assert default_block_sizes("some new GPU", 256) is GENERIC_BLOCK_SIZES[128]
    assert default_block_sizes("TPU v5 lite", 64, "mosaic") is TUNED_BLOCK_SIZES["TPU v5 lite"][128]
    assert default_block_sizes("TPU v9", 128, "mosaic") is GENERIC_MOSAIC_BLOCK_SIZES[128]


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


def test_rejects_bad_settings() -> None:
    with pytest.raises(ValueError, match="BlockSizes.block_kv=48 must be a power of two >= 16"):
        BlockSizes(block_kv=48)
    with pytest.raises(ValueError, match="BlockSizes.block_q_dq=8 must be a power of two >= 16"):
        BlockSizes(block_q_dq=8)
    with pytest.raises(ValueError, match="LaunchParams.num_warps_dkv=3 must be a power of two"):
        LaunchParams(num_warps_dkv=3)
    with pytest.raises(ValueError, match="LaunchParams.num_stages_fwd=0 must be >= 1"):
        LaunchParams(num_stages_fwd=0)
    q = jnp.zeros((1, 256, 2, 64))
    with pytest.raises(ValueError, match="BlockSizes.block_q=64: the TPU .* multiples of 128"):
        flash_attention(q, q, q, block_sizes=BlockSizes(*[64] * 6), lowering="mosaic")
    with pytest.raises(ValueError, match="lowering must be one of"):
        flash_attention(q, q, q, lowering="cuda")
