"""The Hopper (Mosaic GPU) kernels in jax's GPU interpret mode on CPU, against the fp32 reference,
under the race detector, and lowered for an H200; and the errors the lab's glue raises.

The cases, inputs and tolerances are the product's (kiln_testing.attention).
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu
from kiln_testing.attention import (
    TOLERANCES,
    Case,
    check_against_reference,
    forward_and_grads,
    fresh_seed,
    make_inputs,
    relative_errors,
)

from kiln.kernels.block_sizes import TUNED_BLOCK_SIZES, BlockSizes, LaunchParams
from kiln.kernels.device_export import export_for_h200
from kiln.kernels.reference import reference_attention
from kiln_lab import flash_attention_hopper
from kiln_lab.hopper_attention import HopperKernels, flash_attention

ALL = HopperKernels(forward=True, dkv=True, dq=True)
DEEP_RINGS = LaunchParams(num_stages_fwd=3, num_stages_dkv=3, num_stages_dq=3)
FUSED = HopperKernels(forward=True, dkv=True)  # with LaunchParams.fused_dq

# (case, kernels switched on). Tiles default to 64 (BlockSizes()): a wgmma's rows.
CASES = {
    # Several causal programs (the diagonal, skipped tiles, 3-deep rings) and ragged segments,
    # through the three Hopper kernels.
    "all-bf16-d64-causal-gqa4:2-segments-outliers-pad300": (
        Case(300, 4, 2, 64, jnp.bfloat16, True, True, True, BlockSizes(), 1, DEEP_RINGS),
        ALL,
    ),
    # Unequal tiles, padded keys masked in the last kv tile only; padded query rows (segment -1)
    # then see no key at all.
    "fwd-bf16-d128-full-gqa4:1-segments-pad200": (
        Case(200, 4, 1, 128, jnp.bfloat16, False, True, True, BlockSizes(block_kv=128), 1),
        HopperKernels(forward=True),
    ),
    # The Hopper backward after the Triton forward (whose lse is finite where the Hopper one's
    # is +inf), unequal tiles in both kernels; dQ's 256-row programs pad to 256, so the second
    # dK/dV program holds only padding.
    "bwd-bf16-d128-full-gqa4:2-segments-pad100": (
        Case(
            100, 4, 2, 128, jnp.bfloat16, False, True, False,
            BlockSizes(block_q=32, block_kv=32, block_q_dkv=128, block_q_dq=128), 1,
        ),
        HopperKernels(dkv=True, dq=True),
    ),
    # FlashAttention-3's backward: the Hopper dK/dV kernel adds dQ by reduce-adds (read, add,
    # write back in the interpreter); the two warpgroups split dQ's columns, so both visit
    # every q tile of their program, masked ones included.
    "fused-dq-bf16-d128-causal-gqa4:2-segments-outliers-pad300": (
        Case(
            300, 4, 2, 128, jnp.bfloat16, True, True, True, BlockSizes(), 1,
            LaunchParams(num_stages_dkv=3, fused_dq=True),
        ),
        FUSED,
    ),
    # pT kept in fp32 through dsT (fused_fp32_probs), two batch rows.
    "fused-dq-fp32-probs-bf16-d128-full-pad100": (
        Case(
            100, 2, 2, 128, jnp.bfloat16, False, False, False, BlockSizes(),
            launch=LaunchParams(fused_dq=True),
        ),
        HopperKernels(dkv=True, fused_fp32_probs=True),
    ),
}  # fmt: skip


@pytest.fixture
def seed(request: pytest.FixtureRequest) -> int:
    return fresh_seed(request.node.name)


@pytest.mark.parametrize("case, hopper", CASES.values(), ids=CASES.keys())
def test_matches_reference(case: Case, hopper: HopperKernels, seed: int) -> None:
    check_against_reference(functools.partial(flash_attention, hopper=hopper), case, seed)


HOPPER_FORWARD = {"block_q": 64, "block_kv": 128, "num_stages_fwd": 2}
HOPPER_BACKWARD = {"block_q_dkv": 64, "block_kv_dkv": 64, "num_stages_dkv": 2}
HOPPER_DQ = {"block_q_dq": 64, "block_kv_dq": 128, "num_stages_dq": 2}
LAYOUTS = {  # (tile and launch fields on top of the H200's d=128 table entry, kernels)
    "hopper-forward": (HOPPER_FORWARD, HopperKernels(forward=True)),
    "hopper-all": ({**HOPPER_FORWARD, **HOPPER_BACKWARD, **HOPPER_DQ}, ALL),
    # pT in fp32 here: the other form is compiled by test_hopper_compile.py.
    "hopper-fused-dq-fp32-probs": (
        {**HOPPER_FORWARD, **HOPPER_BACKWARD, "fused_dq": True},
        HopperKernels(forward=True, dkv=True, fused_fp32_probs=True),
    ),
}


def table_settings(head_dim: int, fields: dict) -> tuple[BlockSizes, LaunchParams]:
    """The H200's table entry with `fields` (of either dataclass) replaced."""
    blocks, launch = TUNED_BLOCK_SIZES["NVIDIA H200"][head_dim]
    tiles = {name: value for name, value in fields.items() if name.startswith("block_")}
    launch_fields = {name: value for name, value in fields.items() if name not in tiles}
    return replace(blocks, **tiles), replace(launch, **launch_fields)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_lowers_for_h200(layout: str) -> None:
    """The GPU form of the Hopper kernels (operands from registers, in-place accumulators):
    lowering is its check here. Each kernel of the layout lowers once, by name."""
    batch, seq_len, heads, kv_heads, dim = 2, 1000, 8, 2, 128  # 1000: exercises padding
    q = jax.ShapeDtypeStruct((batch, seq_len, heads, dim), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((batch, seq_len, kv_heads, dim), jnp.bfloat16)
    segment_ids = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32)
    fields, hopper = LAYOUTS[layout]
    blocks, launch = table_settings(dim, fields)

    def loss(q, k, v, segment_ids):
        out = flash_attention(
            q, k, v, segment_ids, block_sizes=blocks, launch=launch, hopper=hopper
        )
        return out.astype(jnp.float32).sum()

    grads = jax.grad(loss, argnums=(0, 1, 2))
    module = export_for_h200(grads, q, kv, kv, segment_ids).mlir_module()
    mosaic = ["fwd_hopper"] if hopper.forward else []
    if hopper.dkv:
        mosaic.append("bwd_hopper" if launch.fused_dq else "dkv_hopper")  # bwd: dK, dV and dQ
    mosaic += ["dq_hopper"] if hopper.dq else []
    triton = (not hopper.forward) + (not hopper.dkv) + (not (hopper.dq or launch.fused_dq))
    assert module.count("@mosaic_gpu_v2(") == len(mosaic)
    assert module.count("@__gpu$xla.gpu.triton(") == triton
    for kernel in mosaic:
        assert f"kiln_flash_attention_{kernel}" in module  # what profilers show


@pytest.mark.parametrize("sm_scale", [0.01, 8.0])
def test_hopper_forward_rows_that_start_on_fully_masked_tiles(sm_scale: float, seed: int) -> None:
    """Segments starting mid-tile: some rows see only masked keys in their first tile. At a
    small scale, a huge finite mask value broke the fused scale-and-subtract (inf, then NaN)."""
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.standard_normal((1, 256, 2, 64)), jnp.bfloat16) for _ in range(3))
    segment_ids = jnp.asarray(np.searchsorted([100, 200], np.arange(256), side="right")[None])
    ours = flash_attention(
        q, k, v, segment_ids, sm_scale=sm_scale, block_sizes=BlockSizes(), hopper=ALL
    )
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
    "hopper-all-d64": (
        Case(192, 2, 1, 64, jnp.bfloat16, True, True, False, BlockSizes(), 1, DEEP_RINGS),
        ALL,
    ),
    "hopper-fused-dq-d128": (
        Case(
            128, 4, 1, 128, jnp.bfloat16, False, True, False, BlockSizes(), 1,
            LaunchParams(num_stages_dkv=3, fused_dq=True),
        ),
        FUSED,
    ),
}  # fmt: skip


@pytest.mark.parametrize("case, hopper", RACE_CASES.values(), ids=RACE_CASES.keys())
def test_hopper_kernels_fence_and_wait_for_their_shared_memory(
    case: Case, hopper: HopperKernels, seed: int, race_detector
) -> None:
    """Every Hopper kernel (the forward, dK/dV, dQ, and the fused backward) under the race
    detector: a warpgroup's SMEM stores that TMA then reads (outputs, the fused dQ's staging)
    need a commit_smem fence, and the tiles TMA writes need a barrier wait before the loads. On
    CPU copies run eagerly, so the results are right without either: only the detector sees a
    missing one. (It does not track the reads of wgmma operands.)"""
    q, k, v, segment_ids = make_inputs(case, seed)
    settings = {"block_sizes": case.block_sizes, "launch": case.launch, "hopper": hopper}
    d_out = jnp.ones_like(q)
    jax.block_until_ready(
        forward_and_grads(flash_attention, q, k, v, segment_ids, d_out, **settings)
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
        flash_attention(x, x, x, block_sizes=BlockSizes(block_kv=128), hopper=ALL)


def test_hopper_interpreter_refuses_several_devices() -> None:
    """jax's GPU interpreter keeps one process-wide SMEM and barrier state: under a shard_map over
    two CPU devices the Hopper kernels failed deep inside it ("Barrier remains allocated"). A
    clear error instead; a fresh process, since the device count is fixed when jax starts."""
    script = textwrap.dedent(
        """
        import jax, jax.numpy as jnp, numpy as np
        from jax.sharding import Mesh, PartitionSpec
        from kiln.kernels.block_sizes import BlockSizes
        from kiln_lab.hopper_attention import HopperKernels, flash_attention

        blocks, hopper = BlockSizes(block_kv=128), HopperKernels(forward=True)
        x = jnp.zeros((2, 128, 1, 64), jnp.bfloat16)
        spec = PartitionSpec("data")
        jax.shard_map(
            lambda q, k, v: flash_attention(q, k, v, block_sizes=blocks, hopper=hopper),
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
    with pytest.raises(ValueError, match=r"HopperKernels forward, dkv, dq run Mosaic GPU"):
        flash_attention(x, x, x, block_sizes=BlockSizes(), hopper=ALL, interpret=False)


def test_hopper_fused_dq_refuses_head_dim_64() -> None:
    """Each warpgroup takes half of dQ's columns, a slice of K's 64-wide SMEM tiling."""
    x = jnp.zeros((1, 128, 2, 64), jnp.bfloat16)

    def loss(q, k, v):
        out = flash_attention(
            q, k, v, block_sizes=BlockSizes(), launch=LaunchParams(fused_dq=True), hopper=FUSED
        )
        return out.astype(jnp.float32).sum()

    with pytest.raises(ValueError, match="head dim a multiple of 128, got 64"):
        jax.grad(loss)(x, x, x)


def test_hopper_kernels_take_16_bit_inputs_only() -> None:
    """fp32 inputs keep the Triton kernels even where the switches turn the Hopper ones on."""

    def loss(q, k, v):
        out = flash_attention(q, k, v, block_sizes=BlockSizes(), hopper=ALL)
        return out.astype(jnp.float32).sum()

    for dtype, mosaic_calls in ((jnp.bfloat16, 3), (jnp.float16, 3), (jnp.float32, 0)):
        x = jax.ShapeDtypeStruct((1, 256, 2, 64), dtype)
        module = export_for_h200(jax.grad(loss, argnums=(0, 1, 2)), x, x, x).mlir_module()
        assert module.count("@mosaic_gpu_v2(") == mosaic_calls, dtype


@pytest.mark.parametrize(
    "blocks, launch, hopper, message",
    [
        (
            BlockSizes(block_q=32),
            LaunchParams(),
            HopperKernels(forward=True),
            r"BlockSizes.block_q=32 must be >= 64 with HopperKernels.forward",
        ),
        (
            BlockSizes(),
            LaunchParams(num_stages_fwd=1),
            HopperKernels(forward=True),
            "LaunchParams.num_stages_fwd must be >= 2 with HopperKernels.forward",
        ),
        (
            BlockSizes(block_kv_dq=32),
            LaunchParams(),
            HopperKernels(dq=True),
            r"BlockSizes.block_kv_dq=32 must be >= 64 with HopperKernels.dq",
        ),
        (
            BlockSizes(),
            LaunchParams(fused_dq=True),
            HopperKernels(dq=True),
            "HopperKernels.dq and LaunchParams.fused_dq exclude each other",
        ),
        (
            BlockSizes(),
            LaunchParams(fused_dq=True),
            HopperKernels(fused_fp32_probs=True),
            "fused_fp32_probs is a setting of the Hopper fused backward: set HopperKernels.dkv",
        ),
    ],
)
def test_rejects_settings_the_hopper_kernels_cannot_run(blocks, launch, hopper, message) -> None:
    x = jnp.zeros((1, 128, 2, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match=message):
        flash_attention(x, x, x, block_sizes=blocks, launch=launch, hopper=hopper)
