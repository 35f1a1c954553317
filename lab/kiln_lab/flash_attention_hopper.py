"""Flash attention's forward for Hopper in Pallas Mosaic GPU: warp-specialised, TMA and wgmma.

FlashAttention-3's forward layout, shaped like jax.experimental.pallas.ops.gpu.attention_mgpu.
A program owns two q tiles of one head, one per compute warpgroup; a third warpgroup streams
K/V tiles through a ring of SMEM slots with TMA. The compute warpgroups run q k^T and p v on the
tensor cores (wgmma) and take turns at the softmax (a schedule barrier ping-pongs them), so one
warpgroup's exponentials overlap the other's matmuls. A warpgroup's turn issues this tile's
q k^T and the previous tile's p v back to back, with one wait for both (FlashAttention-3's loop
rotation; jax's kernel drains the tensor cores between them).

Same contract as the product's Triton forward (kiln.kernels.flash_attention: out, and the
base-2 log-sum-exp of the scaled logits), so both forwards share the backward kernels.
Differences from jax's kernel:
- any 16-bit dtype (its SMEM scratch is fp16 only, so bf16 fails there), sm_scale, segment ids
  and the padded-key mask. Masked logits are -inf, and a row whose keys so far are all masked
  is shifted by 0, not by its -inf max (no NaN). The Triton kernel's finite MASK_VALUE would
  not do here: the scale-and-subtract is one fused multiply-add, whose rounding of a huge
  masked logit differs from the rounded max it is measured against;
- two forms of the p v step, as in the backward kernels. On the GPU, FlashAttention-3's and
  jax's: p stays in registers and the running accumulator is updated in place. Pallas' GPU
  interpret mode takes wgmma operands from memory only and has no rule for accumulator
  run_state, so there p goes through SMEM and each p v product starts a fresh accumulator that
  is added to the rescaled running one (lhs_operand, wgmma_group). The forms differ in those
  few lines only; the CPU tests check the interpreted one, lowering the GPU one, and the tuner
  checks each candidate against the fp32 reference on the device before timing it;
- every barrier phase is waited on by the threads that share it (the memory warpgroup drains
  its ring, a warpgroup that finishes early still takes its unused slots), which the
  interpreter's barrier checks require;
- q tiles are scheduled last to first, so under causal masking the longest programs start first.

GPU interpret mode runs each program's warpgroups as CPU threads that execute XLA computations
and block inside callbacks at barriers. XLA's CPU client runs those computations on one thread
pool, sized by PJRT_NPROC (else NPROC, else the cores): smaller than a program's warpgroups, two
of them can wait at a barrier while the third never gets a thread (a hang, seen on 2 cores). The
interpreted kernel therefore refuses to start there (`check_interpreter_threads`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

COMPUTE_WARPGROUPS = 2
WARPGROUPS = COMPUTE_WARPGROUPS + 1  # And one that streams K/V.
COMPUTE_REGISTERS, MEMORY_REGISTERS = 240, 24  # Per thread: split_warpgroups.
WGMMA_ROWS = 64  # A warpgroup's wgmma covers 64 rows: q tiles and kv tiles are multiples.
# GPU interpret mode's settings (CPU tests): lab/tests turn its race detector on.
INTERPRET_PARAMS = plgpu.InterpretGPUParams()
# 16-bit SMEM tiles: (8, 64) tiling with the 128-byte swizzle is what wgmma reads.
WGMMA_TRANSFORMS = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))  # type: ignore[abstract]


@dataclasses.dataclass(frozen=True)
class HopperConfig:
    """Static description of one call of a Hopper kernel (the forward here, or the dQ kernel of
    flash_attention_hopper_dq.py); hopper_attention.py builds it from its own config."""

    causal: bool
    sm_scale: float
    seq_len: int  # Real length; the arrays are padded to a multiple of both tile sizes.
    block_q: int  # Rows per compute warpgroup; a program owns COMPUTE_WARPGROUPS * block_q.
    block_kv: int
    stages: int  # K/V tiles in flight (SMEM ring slots), >= 2 for double buffering.
    interpret: bool
    # dK/dV: a program owns two K/V tiles (block_kv rows per compute warpgroup) and streams q
    # tiles; otherwise it owns two q tiles and streams K/V tiles.
    kv_programs: bool = False
    # dK/dV only: also add each tile's dQ into an fp32 buffer (flash_attention_hopper_dkv.py).
    fused_dq: bool = False
    # Fused dK/dV only: pT stays fp32 through dsT (HopperKernels.fused_fp32_probs).
    fp32_probs: bool = False

    def __post_init__(self) -> None:
        for name in ("block_q", "block_kv"):
            if getattr(self, name) % WGMMA_ROWS:
                raise ValueError(f"Hopper kernels: {name} must be a multiple of {WGMMA_ROWS}")

    @property
    def logit_scale(self) -> float:
        return self.sm_scale * math.log2(math.e)  # The kernels work in base 2.

    @property
    def program_rows(self) -> int:
        return COMPUTE_WARPGROUPS * (self.block_kv if self.kv_programs else self.block_q)

    @property
    def streamed_block(self) -> int:
        return self.block_q if self.kv_programs else self.block_kv

    def fit_to(self, q: jax.Array, kernel: str) -> HopperConfig:
        """Checks q [batch, padded_len, heads, dim] against the tiles, and shortens a ring longer
        than the sequence's K/V tiles (it would only hold out-of-bounds slices)."""
        padded_len, head_dim = q.shape[1], q.shape[3]
        if q.dtype.itemsize != 2 or head_dim % WGMMA_ROWS:
            raise ValueError(
                f"Hopper {kernel} wants 16-bit inputs and head dim a multiple of {WGMMA_ROWS}; "
                f"got {q.dtype}, head dim {head_dim}"
            )
        if self.fused_dq and head_dim % (COMPUTE_WARPGROUPS * WGMMA_ROWS):
            # Each warpgroup's dQ columns are a slice of the K tiles, whose SMEM tiling is 64 wide.
            raise ValueError(
                f"Hopper fused dQ (HopperKernels.dkv with LaunchParams.fused_dq) wants head dim a "
                f"multiple of {COMPUTE_WARPGROUPS * WGMMA_ROWS}, got {head_dim}: use the Triton "
                "dK/dV kernel (dkv=False) for fused_dq, or a dQ kernel (fused_dq=False)"
            )
        if padded_len % self.program_rows or padded_len % self.streamed_block:
            raise ValueError(
                f"Hopper {kernel}: padded length {padded_len} must be a multiple of "
                f"{self.program_rows} and {self.streamed_block}"
            )
        stages = min(self.stages, padded_len // self.streamed_block)
        return dataclasses.replace(self, stages=stages)


def hopper_forward(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array | None,
    config: HopperConfig,
) -> tuple[jax.Array, jax.Array]:
    """Returns the output [batch, seq, heads, dim] and the base-2 lse [batch, heads, seq]."""
    batch, padded_len, num_heads, head_dim = q.shape
    config = config.fit_to(q, "forward")
    stages = config.stages
    transforms = WGMMA_TRANSFORMS
    p_shape = (COMPUTE_WARPGROUPS, config.block_q, config.block_kv)
    p_smem = staging_smem(p_shape, q.dtype, config)
    scratch = (
        plgpu.SMEM((COMPUTE_WARPGROUPS, config.block_q, head_dim), q.dtype, transforms=transforms),
        plgpu.SMEM((stages, config.block_kv, head_dim), q.dtype, transforms=transforms),
        plgpu.SMEM((stages, config.block_kv, head_dim), q.dtype, transforms=transforms),
        plgpu.SMEM((COMPUTE_WARPGROUPS, config.block_q), jnp.float32),
        *p_smem,  # p, on its way to the p v wgmma, in the interpreter
    )
    barriers = (
        plgpu.Barrier(num_barriers=stages),  # K tile landed
        plgpu.Barrier(num_barriers=stages),  # V tile landed
        plgpu.Barrier(num_barriers=COMPUTE_WARPGROUPS),  # q tile landed
        plgpu.Barrier(num_arrivals=COMPUTE_WARPGROUPS, num_barriers=stages),  # K slot free
        plgpu.Barrier(num_arrivals=COMPUTE_WARPGROUPS, num_barriers=stages),  # V slot free
        plgpu.Barrier(num_arrivals=COMPUTE_WARPGROUPS),  # softmax/matmul turn-taking
    )

    return launch(
        "kiln_flash_attention_fwd_hopper",
        _kernel,
        (q, k, v, segment_ids),
        out_type=(
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct((batch, num_heads, padded_len), jnp.float32),
        ),
        grid=(num_heads, padded_len // config.program_rows, batch),
        grid_names=("heads", "q_seq", "batch"),
        scratch=scratch,
        barriers=barriers,
        config=config,
    )


def launch(
    name: str,
    kernel,
    inputs: tuple,
    *,
    out_type,
    grid: tuple[int, ...],
    grid_names: tuple[str, ...],
    scratch: tuple,
    barriers: tuple,
    config: HopperConfig,
):
    """Runs kernel(gmem_refs, smem, barriers, config) as a Mosaic GPU kernel of WARPGROUPS
    warpgroups (axis "wg"). gmem_refs are the inputs' refs, None where an input is None
    (no segment ids), then the outputs'. `name` is the kernel's name in profiles."""
    present = [x is not None for x in inputs]

    def body(*refs):
        rest = iter(refs)
        gmem_refs = [next(rest) if here else None for here in present] + list(rest)
        pl.run_scoped(
            lambda smem, *barrier_refs: kernel(gmem_refs, smem, barrier_refs, config),
            scratch,
            *barriers,
            collective_axes="wg",
        )

    body.__name__ = body.__qualname__ = name
    if config.interpret:
        check_interpreter_threads()
        check_interpreter_devices()
    return plgpu.kernel(
        body,
        out_type=out_type,
        grid=grid,
        grid_names=grid_names,
        num_threads=WARPGROUPS,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=INTERPRET_PARAMS if config.interpret else None,
    )(*[x for x in inputs if x is not None])


def xla_cpu_threads() -> int:
    """The size of XLA's CPU client thread pool, as xla/pjrt/cpu/cpu_client.cc picks it."""
    for name in ("PJRT_NPROC", "NPROC"):
        value = os.environ.get(name, "").strip()
        if value.isdigit():
            return int(value)
    if hasattr(os, "sched_getaffinity"):  # Linux: the cores this process may run on.
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def check_interpreter_threads() -> None:
    """Raises instead of hanging: interpreted, every warpgroup of a program needs a pool thread."""
    threads = xla_cpu_threads()
    if threads < WARPGROUPS:
        raise RuntimeError(
            f"Hopper kernel in GPU interpret mode: XLA's CPU thread pool has {threads} threads, "
            f"fewer than the kernel's {WARPGROUPS} warpgroups, so the interpreter would hang "
            f"at a barrier. Set PJRT_NPROC={WARPGROUPS + 1} in the environment before jax "
            "starts (the tests' BUILD file does), or use the Triton kernels "
            "(HopperKernels() or kiln.kernels.flash_attention)."
        )


def check_interpreter_devices() -> None:
    """Raises instead of failing deep in the interpreter: jax's GPU interpreter keeps one
    process-wide state of SMEM and barriers, so devices that interpret at once (a shard_map, or
    a computation replicated over several CPU devices) trip its checks ("Barrier remains
    allocated")."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.size > 1:
        raise ValueError(
            f"Hopper kernel in GPU interpret mode over {mesh.size} devices ({mesh}): jax's GPU "
            "interpreter runs one device at a time. Interpret on one device, or use the "
            "Triton kernels (HopperKernels() or kiln.kernels.flash_attention)."
        )


def _kernel(gmem_refs, smem, barriers, config: HopperConfig):
    q_ref, k_ref, v_ref, segment_ids_ref, out_ref, lse_ref = gmem_refs
    q_smem, k_smem, v_smem, lse_smem, *p_smem = smem
    k_landed, v_landed, q_landed, k_free, v_free, turn = barriers
    program_row, program_kv_tiles = program_position(q_ref.shape[1], config)
    batch, head = lax.axis_index("batch"), lax.axis_index("heads")

    def compute(wg):
        _compute_warpgroup(
            q_ref.at[batch, :, head],
            segment_ids_ref if segment_ids_ref is None else segment_ids_ref.at[batch],
            out_ref.at[batch, :, head],
            lse_ref.at[batch, head],
            q_smem.at[wg],
            k_smem,
            v_smem,
            p_smem[0].at[wg] if p_smem else None,
            lse_smem.at[wg],
            (k_landed, v_landed, q_landed.at[wg], k_free, v_free, turn),
            q_start=program_row + wg * config.block_q,
            program_kv_tiles=program_kv_tiles,
            first=wg == 0,
            config=config,
        )

    def memory():
        barriers = (k_landed, v_landed, k_free, v_free)
        group = q_ref.shape[2] // k_ref.shape[2]
        stream_kv_tiles(k_ref, v_ref, k_smem, v_smem, barriers, program_kv_tiles, group, config)

    split_warpgroups(compute, memory)


def split_warpgroups(compute, memory, *, static_index: bool = False) -> None:
    """Warp specialisation: the compute warpgroups run compute(wg) with most of the registers,
    the last warpgroup runs memory() (TMA streaming) with few. 2 x 240 + 24 per thread fits the
    SM's 64K registers over three warpgroups of 128 threads: FlashAttention-3's split. ptxas
    (hopper_compile.py, lab/NOTES.md): the memory warpgroups need no more than 24, and
    the backward's compute warpgroups spill less than at 232 + 40. static_index: each compute
    warpgroup gets its own copy of the code with wg a constant, so that its addresses and tile
    bounds fold (twice the code; fewer instructions per tile in the dK/dV and dQ kernels, but the
    forward's 64,128,2 then spills with segment ids: lab/NOTES.md)."""
    wg = lax.axis_index("wg")

    def run_compute(index):
        plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")
        compute(index)

    if static_index:
        for index in range(COMPUTE_WARPGROUPS):
            # wg * 0 + index, not index: a constant that LLVM folds but jax does not (a loop
            # whose body jax folds to a literal fails to lower in jax 0.11.2's Mosaic GPU).
            pl.when(wg == index)(functools.partial(run_compute, wg * 0 + index))
    else:
        pl.when(wg < COMPUTE_WARPGROUPS)(functools.partial(run_compute, wg))

    @pl.when(wg == COMPUTE_WARPGROUPS)
    def _memory():
        plgpu.set_max_registers(MEMORY_REGISTERS, action="decrease")
        memory()


def program_position(num_rows: int, config: HopperConfig) -> tuple[jax.Array, jax.Array]:
    """(this program's first q row, the K/V tiles its last row can see). Programs run last to
    first, so under causal masking the longest start first."""
    num_programs = num_rows // config.program_rows
    program_row = (num_programs - 1 - lax.axis_index("q_seq")) * config.program_rows
    if config.causal:
        return program_row, pl.cdiv(program_row + config.program_rows, config.block_kv)
    return program_row, jnp.int32(pl.cdiv(config.seq_len, config.block_kv))


def stream_kv_tiles(
    k_ref, v_ref, k_smem, v_smem, barriers, num_tiles, group: int, config: HopperConfig
):
    """The memory warpgroup: streams K/V tiles 0..num_tiles of the program's kv head (q head h
    reads kv head h // group) into the ring; a slot is refilled once both compute warpgroups
    have released it."""
    batch, head = lax.axis_index("batch"), lax.axis_index("heads")
    kv_head = lax.div(head, jnp.int32(group))
    k_ref, v_ref = k_ref.at[batch, :, kv_head], v_ref.at[batch, :, kv_head]
    k_landed, v_landed, k_free, v_free = barriers

    def load(tile, slot):
        rows = pl.ds(tile * config.block_kv, config.block_kv)
        plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[slot], k_landed.at[slot])
        plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem.at[slot], v_landed.at[slot])

    fill_ring(load, (k_free, v_free), num_tiles, config.stages)


def fill_ring(load, free_barriers, num_tiles, stages: int) -> None:
    """Runs load(tile, slot) for tiles 0..num_tiles into a ring of `stages` SMEM slots; a slot
    is refilled once every free barrier of it has completed (both compute warpgroups released
    it), and the last releases are drained so that every barrier phase is waited on."""
    for slot in range(stages):
        pl.when(slot < num_tiles)(functools.partial(load, slot, slot))

    def wait_free(slot):
        for barrier in free_barriers:
            plgpu.barrier_wait(barrier.at[slot])

    @pl.loop(stages, jnp.maximum(num_tiles, stages))
    def _refill(tile):
        slot = lax.rem(tile, stages)
        wait_free(slot)
        load(tile, slot)

    @pl.loop(jnp.maximum(num_tiles - stages, 0), num_tiles)
    def _drain(tile):  # The last releases: nothing left to load into those slots.
        wait_free(lax.rem(tile, stages))


def next_slot(slot, stages: int):
    """The ring slot after `slot`. The compute warpgroups carry their slot through the tile
    loops: the tile index modulo a ring of 3 cost each tile a division's instructions, and at
    any depth the carried slot spilled less (lab/NOTES.md)."""
    return jnp.where(slot == stages - 1, 0, slot + 1)


def matmul(a, b, shape: tuple[int, int]) -> jax.Array:
    """a @ b by wgmma into a fresh fp32 accumulator (a and b in SMEM)."""

    def run(acc_ref):
        plgpu.wgmma(acc_ref, a, b)
        return acc_ref[...]

    return pl.run_scoped(run, plgpu.ACC(shape, jnp.float32))


def lhs_operand(x: jax.Array, dtype, staging):
    """x (fp32 in the WGMMA layout) in the inputs' 16-bit dtype as a wgmma's left operand:
    straight from registers on the GPU (FlashAttention-3's form, staging None); through the
    staging SMEM tile in the interpreter, which takes wgmma operands from memory only."""
    if staging is None:
        return x.astype(dtype)
    staging[...] = x.astype(staging.dtype)
    plgpu.commit_smem()
    return staging


def staging_smem(shape: tuple[int, ...], dtype, config: HopperConfig) -> tuple:
    """lhs_operand's staging tiles: in the interpreter only."""
    return (plgpu.SMEM(shape, dtype, transforms=WGMMA_TRANSFORMS),) if config.interpret else ()


def wgmma_group(body, accumulators, config: HopperConfig, fresh=()) -> list[jax.Array]:
    """Runs body(*refs), wgmmas issued back to back, and waits once for them all (so the tensor
    cores go from one to the next without a wait between; jax's attention_mgpu pairs its dV and
    dpT wgmmas so). refs: accumulators starting at `accumulators` (fp32, WGMMA layout), then
    fresh ones, zero, of the shapes in `fresh`; returns their values in that order. On the GPU
    the accumulators are updated in place (run_state: no second set of registers); the
    interpreter has no rule for that, so there every accumulator starts at zero and
    `accumulators` are added after.

    A fresh accumulator costs no instructions when body's first wgmma writes it, before any
    barrier wait or pl.when: ptxas then issues that wgmma without reading the accumulator.
    Otherwise the zeros are set in registers (a CS2R per two) before the branch, every tile
    (lab/NOTES.md)."""
    if config.interpret:
        shapes = [acc.shape for acc in accumulators] + list(fresh)

        def run(*refs):
            body(*refs)
            return [ref[...] for ref in refs]

        values = pl.run_scoped(run, *(plgpu.ACC(shape, jnp.float32) for shape in shapes))
        added = [acc + value for acc, value in zip(accumulators, values)]
        return added + values[len(accumulators) :]
    zeros = [wgmma_zeros(shape) for shape in fresh]
    initial = tuple(plgpu.ACC.init(acc) for acc in (*accumulators, *zeros))
    return list(pl.run_state(lambda refs: body(*refs))(initial))


def accumulate(acc: jax.Array, a, b, config: HopperConfig) -> jax.Array:
    """acc + a @ b: one wgmma, in place on the GPU (wgmma_group)."""
    (acc,) = wgmma_group(lambda acc_ref: plgpu.wgmma(acc_ref, a, b), [acc], config)
    return acc


def wgmma_zeros(shape: tuple[int, int], dtype=jnp.float32) -> jax.Array:
    """Zeros in the WGMMA register layout (an accumulator's, or a register operand's)."""
    return plgpu.layout_cast(jnp.zeros(shape, dtype), plgpu.Layout.WGMMA)


def row_vector(x: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """[rows] -> broadcast along the columns of `shape`."""
    return lax.broadcast_in_dim(x, shape, [0])


def kv_tile_counts(q_start, program_kv_tiles, has_segments: bool, config: HopperConfig):
    """(K/V tiles a q tile visits, how many of the first ones need no mask): causal, those
    before the diagonal; not causal, all but a last tile that holds padded keys. Segment ids
    mask every tile."""
    if config.causal:
        num_tiles = pl.cdiv(q_start + config.block_q, config.block_kv)
        unmasked_tiles = lax.div(q_start, jnp.int32(config.block_kv))
    else:
        num_tiles = program_kv_tiles
        unmasked_tiles = num_tiles - int(config.seq_len % config.block_kv != 0)
    return num_tiles, jnp.int32(0) if has_segments else unmasked_tiles


def load_segments(segment_ids_ref, start, size: int, reduced_dim: int) -> jax.Array:
    """Segment ids of rows (reduced_dim 1) or columns (0) of a [block_q, block_kv] tile. Plain
    loads (no TMA): a few hundred bytes per tile, and Mosaic has no optimised path from GMEM
    into a WGMMA row/column layout."""
    layout = plgpu.Layout.WGMMA.reduce(reduced_dim)
    return plgpu.load(segment_ids_ref.at[pl.ds(start, size)], layout=layout, optimized=False)


def tile_mask(
    q_start, kv_start, q_segments, kv_segments, config: HopperConfig, q_dim: int = 0
) -> jax.Array:
    """[block_q, block_kv] bool, True where the query attends to the key; with q_dim=1 the
    transposed [block_kv, block_q] tile of the dK/dV kernel."""
    sizes = (config.block_q, config.block_kv)
    shape = sizes if q_dim == 0 else sizes[::-1]
    kv_dim = 1 - q_dim
    q_pos = plgpu.broadcasted_iota(jnp.int32, shape, q_dim, layout=plgpu.Layout.WGMMA) + q_start
    kv_pos = plgpu.broadcasted_iota(jnp.int32, shape, kv_dim, layout=plgpu.Layout.WGMMA) + kv_start
    mask = q_pos >= kv_pos if config.causal else kv_pos < config.seq_len
    if kv_segments is not None:
        mask &= lax.broadcast_in_dim(q_segments, shape, [q_dim]) == lax.broadcast_in_dim(
            kv_segments, shape, [kv_dim]
        )
    return mask


def _compute_warpgroup(
    q_ref,
    segment_ids_ref,
    out_ref,
    lse_ref,
    q_smem,
    k_smem,
    v_smem,
    p_smem,
    lse_smem,
    barriers,
    *,
    q_start,
    program_kv_tiles,
    first,
    config: HopperConfig,
):
    """One q tile: online softmax over its K/V tiles, then out and lse back to GMEM via TMA."""
    k_landed, v_landed, q_landed, k_free, v_free, turn = barriers
    block_q, block_kv, stages = config.block_q, config.block_kv, config.stages
    head_dim = q_smem.shape[-1]
    q_rows = pl.ds(q_start, block_q)
    plgpu.copy_gmem_to_smem(q_ref.at[q_rows], q_smem, q_landed)
    plgpu.barrier_wait(q_landed)

    def take_turn():
        plgpu.barrier_arrive(turn)
        plgpu.barrier_wait(turn)

    has_segments = segment_ids_ref is not None
    num_tiles, unmasked_tiles = kv_tile_counts(q_start, program_kv_tiles, has_segments, config)
    q_segments = load_segments(segment_ids_ref, q_start, block_q, 1) if has_segments else None

    def issue_gemms(tile, slot, previous_slot, acc, p_prev):
        """The warpgroup's turn at the tensor cores: q kᵀ of this tile and p v of the previous
        one (into acc, in place on the GPU), issued back to back; the turn is handed over, and
        both are waited for: (acc, logits)."""

        def gemms(acc_ref, logits_ref):
            # q kᵀ first: its fresh accumulator's zeros fold into the wgmma (wgmma_group).
            plgpu.wgmma(logits_ref, q_smem, k_smem.at[slot].transpose((1, 0)))

            @pl.when(tile > 0)
            def _():
                p_operand = lhs_operand(p_prev, v_smem.dtype, p_smem)
                plgpu.wgmma(acc_ref, p_operand, v_smem.at[previous_slot])

            take_turn()  # Hand the tensor cores over while this warpgroup does the softmax.

        plgpu.barrier_wait(k_landed.at[slot])
        acc, logits = wgmma_group(gemms, [acc], config, fresh=[(block_q, block_kv)])
        pl.when(tile > 0)(lambda: plgpu.barrier_arrive(v_free.at[previous_slot]))
        plgpu.barrier_arrive(k_free.at[slot])
        return acc, logits

    def visit_tile(tile, carry, masked):
        acc, row_max, row_sum, p_prev, previous_slot = carry
        slot = next_slot(previous_slot, stages)
        # Loaded before the matmuls so that the global load's latency hides behind them.
        kv_start = tile * block_kv
        if masked and has_segments:
            kv_segments = load_segments(segment_ids_ref, kv_start, block_kv, 0)
        else:
            kv_segments = None
        acc, logits = issue_gemms(tile, slot, previous_slot, acc, p_prev)
        if masked:
            mask = tile_mask(q_start, kv_start, q_segments, kv_segments, config)
            logits = jnp.where(mask, logits, -jnp.inf)
        # The running max is kept scaled, so scaling and subtracting it is one multiply-add.
        new_max = jnp.maximum(row_max, logits.max(axis=1) * config.logit_scale)
        # A row whose keys so far are all masked has max -inf: shift it by 0 instead, so its
        # masked logits give exp2(-inf) = 0 rather than NaN.
        shift = jnp.where(new_max == -jnp.inf, 0.0, new_max)
        correction = jnp.exp2(row_max - shift)
        probs = jnp.exp2(logits * config.logit_scale - row_vector(shift, logits.shape))
        row_sum = row_sum * correction + probs.sum(axis=1)
        acc = acc * row_vector(correction, acc.shape)  # this tile's p v adds to it next turn
        p = probs.astype(v_smem.dtype)
        # As in jax's attention_mgpu: the softmax finishes before the turn is handed over.
        acc, row_sum, new_max, p = lax.optimization_barrier((acc, row_sum, new_max, p))
        plgpu.barrier_arrive(turn)  # Softmax done: the other warpgroup may finish its turn.
        plgpu.barrier_wait(v_landed.at[slot])
        plgpu.barrier_wait(turn)  # Wait until the tensor cores are ours again.
        return acc, new_max, row_sum, p, slot

    def skip_tile(_, previous_slot):
        # Tiles the other warpgroup still needs: take them and release them so the ring keeps
        # moving, and keep the turn-taking in step.
        slot = next_slot(previous_slot, stages)
        plgpu.barrier_wait(k_landed.at[slot])
        plgpu.barrier_wait(v_landed.at[slot])
        plgpu.barrier_arrive(k_free.at[slot])
        plgpu.barrier_arrive(v_free.at[slot])
        take_turn()
        take_turn()
        return slot

    carry = (
        wgmma_zeros((block_q, head_dim)),
        plgpu.layout_cast(
            jnp.full((block_q,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1)
        ),
        plgpu.layout_cast(jnp.zeros((block_q,), jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
        wgmma_zeros((block_q, block_kv), v_smem.dtype),  # p of tile -1: never used
        jnp.int32(stages - 1),  # the slot of tile -1
    )
    pl.when(jnp.logical_not(first))(take_turn)  # The second warpgroup starts one turn behind.
    carry = lax.fori_loop(0, unmasked_tiles, functools.partial(visit_tile, masked=False), carry)
    carry = lax.fori_loop(
        unmasked_tiles, num_tiles, functools.partial(visit_tile, masked=True), carry
    )
    acc, row_max, row_sum, p, last_slot = carry
    # The last tile's p v, in the turn its softmax ended with.
    acc = accumulate(acc, lhs_operand(p, v_smem.dtype, p_smem), v_smem.at[last_slot], config)
    plgpu.barrier_arrive(v_free.at[last_slot])
    lax.fori_loop(num_tiles, program_kv_tiles, skip_tile, last_slot)
    pl.when(first)(take_turn)

    # A padded query row can see no key at all (not causal, segment ids: its segment is -1 and
    # the padded keys are masked). Its out is 0 and its lse +inf, so that the backward gives
    # every key probability 0 for it, where 0/0 and lse -inf gave NaN gradients.
    no_keys = row_sum == 0.0
    safe_sum = jnp.where(no_keys, 1.0, row_sum)
    q_smem[...] = (acc / row_vector(safe_sum, acc.shape)).astype(q_smem.dtype)
    lse_smem[...] = jnp.where(no_keys, jnp.inf, row_max + jnp.log2(safe_sum))
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_smem, out_ref.at[q_rows])
    plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[q_rows])
    plgpu.wait_smem_to_gmem(0)
