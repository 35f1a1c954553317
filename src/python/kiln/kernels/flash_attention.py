"""Flash attention in Pallas: forward, dK/dV and dQ kernels joined by `jax.custom_vjp`.

Shaped like jax.experimental.pallas.ops.gpu.attention (Triton lowering on GPU, interpret mode on
CPU), plus grouped-query attention, padding of ragged lengths and per-device block sizes.
docs/attention-kernel.md describes the design; the short version:

- forward: grid (q blocks, batch, heads); each program keeps one q tile and loops over kv tiles
  with an online softmax in base 2, writing the output and the row log-sum-exp (lse, base 2).
- dK/dV: grid (kv blocks, batch, kv heads); each program loops over the q heads of its group and
  their q tiles, so GQA gradients are summed in the kernel without repeating K/V.
- dQ: grid (q blocks, batch, heads); each program loops over kv tiles. Or, with
  BlockSizes.fused_dq, no dQ kernel: the dK/dV kernel (Triton or Hopper) adds each tile's dQ
  into an fp32 buffer with atomics or TMA reduce-adds (5 matmuls instead of 7; dQ's summation
  order then varies between GPU runs).
- Hopper kernels (BlockSizes.hopper_forward, hopper_dkv, hopper_dq; 16-bit inputs): that kernel
  runs as a Mosaic GPU kernel instead (flash_attention_hopper*.py: warp-specialised, TMA, wgmma)
  with the same inputs and outputs.
- GQA: q head h reads kv head h // group in the BlockSpec index maps.
- Causal: loop bounds skip tiles fully in the future; only tiles on the diagonal build a mask.
- Lengths that are not a multiple of the block are padded here; padded keys are masked.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kiln.kernels.flash_attention_hopper import WGMMA_ROWS, HopperConfig, hopper_forward
from kiln.kernels.flash_attention_hopper_dkv import hopper_dkv
from kiln.kernels.flash_attention_hopper_dq import hopper_dq

# Finite on purpose: a row whose keys are all masked inside one tile gets exp2(0) = 1 instead of
# NaN, and the online softmax's correction erases it once a real key arrives (every query attends
# at least to itself, so one always does).
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
LOG2_E = math.log2(math.e)
MIN_BLOCK = 16  # Triton's smallest dot operand dimension.


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes (powers of two, >= 16) and Triton launch parameters of the three kernels.

    block_q, block_kv: forward (a program owns a q tile and loops over kv tiles).
    block_q_dkv, block_kv_dkv: dK/dV (a program owns a kv tile, loops over q tiles and heads).
    block_q_dq, block_kv_dq: dQ (a program owns a q tile and loops over kv tiles).
    num_warps_*, num_stages_*: Triton's warps per program and software-pipelining depth, per
    kernel (each kernel has its own best setting on the device).
    fused_dq: the dK/dV kernel also computes dQ and adds it into an fp32 buffer (5 matmuls
    instead of 7, no dQ kernel; dQ's summation order then varies between runs on a GPU): with
    atomics in the Triton kernel (FlashAttention-2's layout), with TMA reduce-adds in the Hopper
    one (hopper_dkv: FlashAttention-3's backward, head dim a multiple of 128). Off: a separate
    dQ kernel recomputes what it needs.
    hopper_forward: for 16-bit inputs the forward is the Mosaic GPU kernel of
    flash_attention_hopper.py; block_q is then each compute warpgroup's rows (a program owns
    two q tiles), num_stages_fwd the K/V tiles in flight, and num_warps_fwd is unused (three
    warpgroups). fp32 inputs keep the Triton forward with the same fields.
    hopper_dq: for 16-bit inputs the dQ kernel is the Mosaic GPU kernel of
    flash_attention_hopper_dq.py (the forward's layout: block_q_dq rows per compute warpgroup,
    num_stages_dq K/V tiles in flight, num_warps_dq unused). Not with fused_dq.
    hopper_dkv: likewise for dK/dV (flash_attention_hopper_dkv.py: block_kv_dkv rows per compute
    warpgroup, num_stages_dkv q/dO tiles of block_q_dkv in flight).
    hopper_fused_fp32_probs: in the Hopper fused backward (hopper_dkv with fused_dq), keep pT
    in fp32 through dsT, as the other kernels do; off, it is rounded to the inputs' dtype once
    computed, which frees registers (~15 local loads/stores per tile instead of ~56, ~24 more
    instructions; the tuner times both).
    """

    block_q: int = 64
    block_kv: int = 64
    block_q_dkv: int = 64
    block_kv_dkv: int = 64
    block_q_dq: int = 64
    block_kv_dq: int = 64
    num_warps_fwd: int = 4
    num_warps_dkv: int = 4
    num_warps_dq: int = 4
    num_stages_fwd: int = 2
    num_stages_dkv: int = 2
    num_stages_dq: int = 2
    fused_dq: bool = False
    hopper_forward: bool = False
    hopper_dq: bool = False
    hopper_dkv: bool = False
    hopper_fused_fp32_probs: bool = False

    def __post_init__(self) -> None:
        for name in _BLOCK_FIELDS:
            size = getattr(self, name)
            if size < self._smallest(name) or size & (size - 1):
                raise ValueError(
                    f"BlockSizes.{name}={size} must be a power of two >= {self._smallest(name)}"
                    + (" (a Hopper kernel's tile)" if self._smallest(name) > MIN_BLOCK else "")
                )
        for switch, stages in _HOPPER_STAGES.items():
            if getattr(self, switch) and getattr(self, stages) < 2:
                raise ValueError(f"BlockSizes.{stages} must be >= 2 with {switch}")
        if self.hopper_dq and self.fused_dq:
            raise ValueError("BlockSizes: hopper_dq and fused_dq exclude each other (no dQ kernel)")
        if self.hopper_fused_fp32_probs and not (self.hopper_dkv and self.fused_dq):
            raise ValueError(
                "BlockSizes.hopper_fused_fp32_probs is a setting of the Hopper fused backward: "
                "set hopper_dkv and fused_dq with it, or leave it False"
            )

    def _smallest(self, name: str) -> int:
        # wgmma covers 64 rows of a warpgroup: the Hopper kernels' tiles are multiples of 64.
        hopper = any(
            getattr(self, switch) and name in fields for switch, fields in _HOPPER_FIELDS.items()
        )
        return WGMMA_ROWS if hopper else MIN_BLOCK

    def fit_to(self, seq_len: int) -> BlockSizes:
        """Shrinks tiles longer than the (power-of-two rounded) sequence: no work on pure padding."""
        limit = pl.next_power_of_2(seq_len)
        return dataclasses.replace(
            self,
            **{
                name: min(getattr(self, name), max(self._smallest(name), limit))
                for name in _BLOCK_FIELDS
            },
        )

    @property
    def padding_multiple(self) -> int:
        """What the padded length must be a multiple of (a Hopper kernel's program owns two q
        tiles)."""
        sizes = [getattr(self, name) for name in _BLOCK_FIELDS]
        sizes += [2 * self.block_q] if self.hopper_forward else []
        sizes += [2 * self.block_q_dq] if self.hopper_dq else []
        sizes += [2 * self.block_kv_dkv] if self.hopper_dkv else []
        return max(sizes)


_BLOCK_FIELDS = tuple(
    f"block_{suffix}" for suffix in ("q", "kv", "q_dkv", "kv_dkv", "q_dq", "kv_dq")
)
_HOPPER_FIELDS = {  # Tiles of the Mosaic GPU kernels: multiples of 64.
    "hopper_forward": ("block_q", "block_kv"),
    "hopper_dkv": ("block_q_dkv", "block_kv_dkv"),
    "hopper_dq": ("block_q_dq", "block_kv_dq"),
}
_HOPPER_STAGES = {  # Their ring depths: at least 2.
    "hopper_forward": "num_stages_fwd",
    "hopper_dkv": "num_stages_dkv",
    "hopper_dq": "num_stages_dq",
}

# Tuned on an H200 on 2026-11-30 by benchmarks/attention_tune.py (each kernel on its own, causal,
# seq 4096, bf16; numbers in benchmarks/RESULTS.md). The H100 shares the chip and uses them unmeasured.
_HOPPER_BLOCK_SIZES = {
    64: BlockSizes(
        block_q=64,
        block_kv=64,
        block_q_dkv=64,
        block_kv_dkv=64,
        block_q_dq=128,
        block_kv_dq=64,
        num_warps_fwd=4,
        num_warps_dkv=4,
        num_warps_dq=8,
        num_stages_fwd=3,
        num_stages_dkv=2,
        num_stages_dq=3,
    ),
    128: BlockSizes(
        block_q=128,
        block_kv=128,
        block_q_dkv=64,
        block_kv_dkv=64,
        block_q_dq=128,
        block_kv_dq=128,
        num_warps_fwd=8,
        num_warps_dkv=4,
        num_warps_dq=8,
        num_stages_fwd=3,
        num_stages_dkv=2,
        num_stages_dq=2,
    ),
}
TUNED_BLOCK_SIZES: dict[str, dict[int, BlockSizes]] = {
    "NVIDIA H200": _HOPPER_BLOCK_SIZES,
    "NVIDIA H100 80GB HBM3": _HOPPER_BLOCK_SIZES,
}
# Any other device (CPU interpret mode included): jax's own kernel's kind of sizes.
GENERIC_BLOCK_SIZES = {64: BlockSizes(), 128: BlockSizes(num_warps_fwd=8)}


def default_block_sizes(device_kind: str, head_dim: int) -> BlockSizes:
    """Block sizes for a jax `device_kind` and head dim; generic ones for unknown devices."""
    by_head_dim = TUNED_BLOCK_SIZES.get(device_kind, GENERIC_BLOCK_SIZES)
    return by_head_dim.get(head_dim, by_head_dim[max(by_head_dim)])


@dataclasses.dataclass(frozen=True)
class _KernelConfig:
    """Everything static about one call; a custom_vjp non-differentiable argument."""

    causal: bool
    sm_scale: float
    seq_len: int  # Real length; arrays reaching the kernels are padded to padded_len.
    padded_len: int
    block_sizes: BlockSizes
    interpret: bool
    hopper_forward: HopperConfig | None = None  # Set: the forward is the Mosaic GPU kernel.
    hopper_dkv: HopperConfig | None = None  # Set: so is the dK/dV kernel.
    hopper_dq: HopperConfig | None = None  # Set: so is the dQ kernel.

    @property
    def masks_padded_keys(self) -> bool:
        # With causal masking a real query never sees a padded (later) key; padded query rows
        # are sliced off and get zero gradients, so only non-causal calls need the length mask.
        return self.padded_len > self.seq_len and not self.causal

    @property
    def logit_scale(self) -> float:
        # exp2 is cheaper than exp on GPUs: fold log2(e) into the softmax scale once.
        return self.sm_scale * LOG2_E


@functools.partial(jax.jit, static_argnames=("causal", "sm_scale", "block_sizes", "interpret"))
def flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array | None = None,
    *,
    causal: bool = True,
    sm_scale: float | None = None,
    block_sizes: BlockSizes | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """Softmax attention. q: [batch, seq, heads, dim]; k, v: [batch, seq, kv_heads, dim].

    segment_ids: int32 [batch, seq] or None; tokens attend only within their segment.
    Returns q's dtype and shape. sm_scale defaults to 1/sqrt(dim). block_sizes defaults to the
    table entry for the target device. interpret defaults to True when lowering for CPU.
    """
    _check_inputs(q, k, v, segment_ids)
    seq_len, head_dim = q.shape[1], q.shape[3]
    platform, device_kind, capability = _target_device()
    config = _kernel_config(
        seq_len,
        head_dim,
        q.dtype,
        causal=causal,
        sm_scale=1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale),
        block_sizes=block_sizes or default_block_sizes(device_kind, head_dim),
        interpret=platform == "cpu" if interpret is None else interpret,
    )
    _check_hopper_target(config, platform, device_kind, capability)
    q, k, v = (_pad_seq(x, config.padded_len, 0) for x in (q, k, v))
    if segment_ids is not None:
        segment_ids = _pad_seq(segment_ids.astype(jnp.int32), config.padded_len, -1)
    return _flash_attention(q, k, v, segment_ids, config)[:, :seq_len]


def _kernel_config(
    seq_len: int,
    head_dim: int,
    dtype: jnp.dtype,
    *,
    causal: bool,
    sm_scale: float,
    block_sizes: BlockSizes,
    interpret: bool,
) -> _KernelConfig:
    """Tiles fitted to the sequence, the padded length, and the Hopper kernels to use."""
    block_sizes = block_sizes.fit_to(seq_len)
    unit = block_sizes.padding_multiple
    config = _KernelConfig(
        causal=causal,
        sm_scale=sm_scale,
        seq_len=seq_len,
        padded_len=-(-seq_len // unit) * unit,
        block_sizes=block_sizes,
        interpret=interpret,
    )
    if jnp.dtype(dtype).itemsize != 2:  # wgmma takes 16-bit operands: fp32 stays on Triton.
        return config
    kernels = {
        switch: HopperConfig(
            causal=causal,
            sm_scale=sm_scale,
            seq_len=seq_len,
            block_q=getattr(block_sizes, block_q),
            block_kv=getattr(block_sizes, block_kv),
            stages=getattr(block_sizes, _HOPPER_STAGES[switch]),
            interpret=interpret,
            kv_programs=switch == "hopper_dkv",
            fused_dq=switch == "hopper_dkv" and block_sizes.fused_dq,
            fp32_probs=switch == "hopper_dkv" and block_sizes.hopper_fused_fp32_probs,
        )
        for switch, (block_q, block_kv) in _HOPPER_FIELDS.items()
        if getattr(block_sizes, switch)
    }
    return dataclasses.replace(
        config,
        hopper_forward=kernels.get("hopper_forward"),
        hopper_dkv=kernels.get("hopper_dkv"),
        hopper_dq=kernels.get("hopper_dq"),
    )


def _check_inputs(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None) -> None:
    if q.ndim != 4 or k.ndim != 4 or k.shape != v.shape:
        raise ValueError(
            "flash_attention wants q [batch, seq, heads, dim] and k, v of equal shape "
            f"[batch, seq, kv_heads, dim]; got q={q.shape}, k={k.shape}, v={v.shape}"
        )
    (batch, seq_len, num_heads, head_dim), num_kv_heads = q.shape, k.shape[2]
    if k.shape[:2] != (batch, seq_len) or k.shape[3] != head_dim:
        raise ValueError(
            f"k/v {k.shape} must share batch, seq and dim with q {q.shape} (self-attention)"
        )
    if num_heads % num_kv_heads:
        raise ValueError(f"q heads ({num_heads}) must be a multiple of kv heads ({num_kv_heads})")
    if head_dim < MIN_BLOCK or head_dim & (head_dim - 1):
        raise ValueError(f"head dim {head_dim} must be a power of two >= {MIN_BLOCK} (64, 128)")
    if not (q.dtype == k.dtype == v.dtype) or not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(f"q, k, v must share one float dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if segment_ids is not None and (
        segment_ids.shape != (batch, seq_len) or not jnp.issubdtype(segment_ids.dtype, jnp.integer)
    ):
        raise ValueError(
            f"segment_ids must be integer [batch, seq] = {(batch, seq_len)}; "
            f"got {segment_ids.dtype}{list(segment_ids.shape)}"
        )


def _target_device() -> tuple[str, str, str | None]:
    """(platform, device_kind, CUDA compute capability or None) being lowered for. An abstract
    mesh's device (jax.export for a GPU from a CPU machine) wins over the local default device;
    its compute capability is unknown."""
    abstract_device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    if abstract_device is not None:
        return abstract_device.platform, abstract_device.device_kind, None
    device = jax.devices()[0]
    return device.platform, device.device_kind, getattr(device, "compute_capability", None)


def _check_hopper_target(
    config: _KernelConfig, platform: str, device_kind: str, capability: str | None
) -> None:
    """The Mosaic GPU kernels compile for Hopper only (wgmma, sm_90); elsewhere they run only
    in interpret mode."""
    switches = [
        name for name in ("hopper_forward", "hopper_dkv", "hopper_dq") if getattr(config, name)
    ]
    if not switches or config.interpret:
        return
    on_hopper = platform in ("gpu", "cuda") and (capability is None or capability.startswith("9."))
    if not on_hopper:
        raise ValueError(
            f"BlockSizes.{', '.join(switches)} run Mosaic GPU kernels for Hopper (sm_90: H100, "
            f"H200), not {device_kind!r} ({platform}, compute capability {capability}): set them "
            "False for this device, or run in interpret mode"
        )


def _pad_seq(x: jax.Array, padded_len: int, value: int) -> jax.Array:
    padding = [(0, 0)] * x.ndim
    padding[1] = (0, padded_len - x.shape[1])
    return jnp.pad(x, padding, constant_values=value)


# ----------------------------------------------------------------------------------------------
# custom_vjp glue: arrays here are padded to config.padded_len.


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _flash_attention(q, k, v, segment_ids, config: _KernelConfig):
    out, _ = _forward(q, k, v, segment_ids, config)
    return out


def _flash_attention_fwd(q, k, v, segment_ids, config: _KernelConfig):
    out, lse = _forward(q, k, v, segment_ids, config)
    return out, (q, k, v, segment_ids, out, lse)


def _flash_attention_bwd(config: _KernelConfig, residuals, d_out):
    q, k, v, segment_ids, out, lse = residuals
    # delta_i = sum_d out_i * dout_i = sum_j p_ij * dp_ij: an elementwise product and row sum
    # that XLA fuses well, so it needs no kernel of its own.
    delta = jnp.einsum("bthd,bthd->bht", out.astype(jnp.float32), d_out.astype(jnp.float32))
    if config.hopper_dkv is not None:
        dkv = hopper_dkv(q, k, v, segment_ids, d_out, lse, delta, config.hopper_dkv)
    else:
        dkv = _backward_dkv(q, k, v, segment_ids, d_out, lse, delta, config)
    if config.block_sizes.fused_dq:  # dQ came with dK/dV: fp32, not yet scaled
        dq, dk, dv = dkv
        dq = (dq * config.sm_scale).astype(q.dtype)
    else:
        dk, dv = dkv
        if config.hopper_dq is not None:
            dq = hopper_dq(q, k, v, segment_ids, d_out, lse, delta, config.hopper_dq)
        else:
            dq = _backward_dq(q, k, v, segment_ids, d_out, lse, delta, config)
    return dq, dk, dv, None


_flash_attention.defvjp(_flash_attention_fwd, _flash_attention_bwd)


# ----------------------------------------------------------------------------------------------
# Pieces shared by the kernels.


def _dot(a: jax.Array, b: jax.Array) -> jax.Array:
    """a @ b with fp32 accumulation; fp32 operands stay fp32 (Triton would use TF32 by default)."""
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return plgpu.dot(a, b, precision=precision)


def _tile_mask(
    config: _KernelConfig,
    q_positions: jax.Array,
    kv_positions: jax.Array,
    q_segments: jax.Array | None,
    kv_segments: jax.Array | None,
    on_diagonal: bool,
) -> jax.Array | None:
    """[q tile, kv tile] bool mask (True = attend), or None when nothing is masked. Causal
    masking is only needed on tiles that straddle the diagonal."""
    masks = []
    if config.causal and on_diagonal:
        masks.append(q_positions[:, None] >= kv_positions[None, :])
    if config.masks_padded_keys:
        masks.append((kv_positions < config.seq_len)[None, :])
    if q_segments is not None and kv_segments is not None:
        masks.append(q_segments[:, None] == kv_segments[None, :])
    return functools.reduce(jnp.logical_and, masks) if masks else None


def _scaled_logits(
    config: _KernelConfig,
    q: jax.Array,
    k: jax.Array,
    q_positions: jax.Array,
    kv_positions: jax.Array,
    q_segments: jax.Array | None,
    kv_segments: jax.Array | None,
    on_diagonal: bool,
) -> jax.Array:
    """Masked q k^T * sm_scale * log2(e): fp32 [q tile, kv tile] logits in base 2."""
    logits = _dot(q, k.T) * config.logit_scale
    mask = _tile_mask(config, q_positions, kv_positions, q_segments, kv_segments, on_diagonal)
    return logits if mask is None else jnp.where(mask, logits, MASK_VALUE)


def _kv_tile_ranges(config: _KernelConfig, q_start, block_q: int, block_kv: int):
    """[(first, stop, on_diagonal)] kv tiles a q tile visits: causal skips tiles in the future and
    masks only those straddling the diagonal; tiles made only of padding are never visited."""
    real_tiles = pl.cdiv(config.seq_len, block_kv)
    if not config.causal:
        return [(0, real_tiles, False)]
    stop = jnp.minimum(lax.div(q_start + block_q + block_kv - 1, block_kv), real_tiles)
    past = jnp.minimum(lax.div(q_start, block_kv), stop)  # Tiles that end before q_start.
    return [(0, past, False), (past, stop, True)]


def _q_tile_ranges(config: _KernelConfig, kv_start, block_q: int, block_kv: int):
    """[(first, stop, on_diagonal)] q tiles that see a kv tile (the mirror of _kv_tile_ranges)."""
    real_tiles = pl.cdiv(config.seq_len, block_q)
    if not config.causal:
        return [(0, real_tiles, False)]
    first = lax.div(kv_start, block_q)  # Earlier q tiles end before this kv tile starts.
    future = jnp.clip(lax.div(kv_start + block_kv + block_q - 1, block_q), first, real_tiles)
    return [(first, future, True), (future, real_tiles, False)]


def _loop_over_tiles(ranges, visit_tile, carry):
    """Runs visit_tile(tile, carry, on_diagonal=...) over each (first, stop, on_diagonal) range."""
    for first, stop, on_diagonal in ranges:
        carry = lax.fori_loop(
            first, stop, functools.partial(visit_tile, on_diagonal=on_diagonal), carry
        )
    return carry


def _segments(segment_ids_ref, start, size: int) -> jax.Array | None:
    return None if segment_ids_ref is None else segment_ids_ref[pl.ds(start, size)]


def _segment_spec(padded_len: int) -> pl.BlockSpec:
    return pl.BlockSpec((None, padded_len), lambda _, b, __: (b, 0))


def _q_tile_specs(q_shape, num_kv_heads: int, block_q: int) -> tuple[pl.BlockSpec, ...]:
    """BlockSpecs of the kernels whose grid is (q tiles, batch, heads): the program's q-shaped
    tile, its kv head's whole K or V (q head h reads kv head h // group), its row-stats tile."""
    _, padded_len, num_heads, head_dim = q_shape
    group = num_heads // num_kv_heads
    return (
        pl.BlockSpec((None, block_q, None, head_dim), lambda i, b, h: (b, i, h, 0)),
        pl.BlockSpec((None, padded_len, None, head_dim), lambda _, b, h: (b, 0, h // group, 0)),
        pl.BlockSpec((None, None, block_q), lambda i, b, h: (b, h, i)),
    )


def _compiler_params(num_warps: int, num_stages: int) -> plgpu.CompilerParams:
    # Pins the Triton lowering (jax 0.11 warns it is deprecated in favour of Mosaic GPU, which
    # cannot run in interpret mode with these BlockSpecs).
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


# ----------------------------------------------------------------------------------------------
# Forward.


def _forward_kernel(q_ref, k_ref, v_ref, segment_ids_ref, out_ref, lse_ref, *, config):
    block_q, block_kv = config.block_sizes.block_q, config.block_sizes.block_kv
    q_start = pl.program_id(0) * block_q
    q = q_ref[...]
    q_positions = q_start + jnp.arange(block_q)
    q_segments = _segments(segment_ids_ref, q_start, block_q)

    def visit_kv_tile(kv_tile, carry, on_diagonal):
        acc, row_max, row_sum = carry
        kv_start = kv_tile * block_kv
        kv_slice = pl.ds(kv_start, block_kv)
        logits = _scaled_logits(
            config,
            q,
            k_ref[kv_slice, :],
            q_positions,
            kv_start + jnp.arange(block_kv),
            q_segments,
            _segments(segment_ids_ref, kv_start, block_kv),
            on_diagonal,
        )
        new_max = jnp.maximum(row_max, logits.max(axis=-1))
        correction = jnp.exp2(row_max - new_max)
        probs = jnp.exp2(logits - new_max[:, None])
        row_sum = row_sum * correction + probs.sum(axis=-1)
        v = v_ref[kv_slice, :]
        acc = acc * correction[:, None] + _dot(probs.astype(v.dtype), v)
        return acc, new_max, row_sum

    init = (
        jnp.zeros(q.shape, jnp.float32),
        jnp.full((block_q,), -jnp.inf, jnp.float32),
        jnp.zeros((block_q,), jnp.float32),
    )
    ranges = _kv_tile_ranges(config, q_start, block_q, block_kv)
    acc, row_max, row_sum = _loop_over_tiles(ranges, visit_kv_tile, init)
    out_ref[...] = (acc / row_sum[:, None]).astype(out_ref.dtype)
    lse_ref[...] = row_max + jnp.log2(row_sum)


def _forward(q, k, v, segment_ids, config: _KernelConfig) -> tuple[jax.Array, jax.Array]:
    """Returns the output [batch, seq, heads, dim] and the base-2 lse [batch, heads, seq]."""
    if config.hopper_forward is not None:
        return hopper_forward(q, k, v, segment_ids, config.hopper_forward)
    batch, padded_len, num_heads, _ = q.shape
    blocks = config.block_sizes
    q_tile, kv_whole, row_stats_tile = _q_tile_specs(q.shape, k.shape[2], blocks.block_q)
    return pl.pallas_call(
        functools.partial(_forward_kernel, config=config),
        grid=(padded_len // blocks.block_q, batch, num_heads),
        in_specs=[
            q_tile,
            kv_whole,
            kv_whole,
            None if segment_ids is None else _segment_spec(padded_len),
        ],
        out_specs=[q_tile, row_stats_tile],
        out_shape=[
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct((batch, num_heads, padded_len), jnp.float32),
        ],
        compiler_params=_compiler_params(blocks.num_warps_fwd, blocks.num_stages_fwd),
        interpret=config.interpret,
        name="kiln_flash_attention_fwd",
    )(q, k, v, segment_ids)


# ----------------------------------------------------------------------------------------------
# Backward. With p = exp2(logits - lse), dp = dout v^T and ds = p * (dp - delta):
#   dV = p^T dout,  dK = sm_scale * ds^T q,  dQ = sm_scale * ds k.


def _backward_dkv_kernel(
    q_ref, k_ref, v_ref, segment_ids_ref, d_out_ref, lse_ref, delta_ref, *out_refs, config
):
    # Fused: (zeroed dQ input, the dQ accumulator aliasing it, dK, dV); else (dK, dV).
    dq_ref = out_refs[1] if config.block_sizes.fused_dq else None
    dk_ref, dv_ref = out_refs[-2:]
    block_q, block_kv = config.block_sizes.block_q_dkv, config.block_sizes.block_kv_dkv
    kv_start = pl.program_id(0) * block_kv
    k, v = k_ref[...], v_ref[...]
    kv_positions = kv_start + jnp.arange(block_kv)
    kv_segments = _segments(segment_ids_ref, kv_start, block_kv)
    group = q_ref.shape[1]
    ranges = _q_tile_ranges(config, kv_start, block_q, block_kv)

    def visit_q_tile(q_tile, carry, on_diagonal, head):
        dk, dv = carry
        q_start = q_tile * block_q
        q_slice = pl.ds(q_start, block_q)
        q = q_ref[q_slice, head, :]
        logits = _scaled_logits(
            config,
            q,
            k,
            q_start + jnp.arange(block_q),
            kv_positions,
            _segments(segment_ids_ref, q_start, block_q),
            kv_segments,
            on_diagonal,
        )
        probs = jnp.exp2(logits - lse_ref[head, q_slice][:, None])
        d_out = d_out_ref[q_slice, head, :]
        dv = dv + _dot(probs.astype(d_out.dtype).T, d_out)
        d_probs = _dot(d_out, v.T)
        d_logits = probs * (d_probs - delta_ref[head, q_slice][:, None])
        dk = dk + _dot(d_logits.astype(q.dtype).T, q)
        if dq_ref is not None:  # sm_scale is applied once, outside the kernel
            plgpu.atomic_add(
                dq_ref, (q_slice, head, slice(None)), _dot(d_logits.astype(k.dtype), k)
            )
        return dk, dv

    def visit_head(head, carry):
        # The q heads of this kv head's group: GQA gradients are summed here, in registers.
        return _loop_over_tiles(ranges, functools.partial(visit_q_tile, head=head), carry)

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = lax.fori_loop(0, group, visit_head, (zeros, zeros))
    dk_ref[...] = (dk * config.sm_scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _backward_dkv(q, k, v, segment_ids, d_out, lse, delta, config: _KernelConfig):
    """(dK, dV), or (unscaled fp32 dQ, dK, dV) with fused_dq."""
    batch, padded_len, num_kv_heads, head_dim = k.shape
    group = q.shape[2] // num_kv_heads
    blocks = config.block_sizes
    block_kv = blocks.block_kv_dkv
    q_group = pl.BlockSpec((None, padded_len, group, head_dim), lambda _, b, h: (b, 0, h, 0))
    row_stats_group = pl.BlockSpec((None, group, padded_len), lambda _, b, h: (b, h, 0))
    kv_tile = pl.BlockSpec((None, block_kv, None, head_dim), lambda j, b, h: (b, j, h, 0))
    inputs = [q, k, v, segment_ids, d_out, lse, delta]
    in_specs = [
        q_group,
        kv_tile,
        kv_tile,
        None if segment_ids is None else _segment_spec(padded_len),
        q_group,
        row_stats_group,
        row_stats_group,
    ]
    out_specs = [kv_tile, kv_tile]
    out_shape = [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)]
    aliases = {}
    if blocks.fused_dq:
        inputs.append(jnp.zeros(q.shape, jnp.float32))
        in_specs.append(q_group)
        out_specs.insert(0, q_group)
        out_shape.insert(0, jax.ShapeDtypeStruct(q.shape, jnp.float32))
        aliases = {len(jax.tree.leaves(inputs)) - 1: 0}  # None (no segment ids) is no input
    return pl.pallas_call(
        functools.partial(_backward_dkv_kernel, config=config),
        grid=(padded_len // block_kv, batch, num_kv_heads),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=_compiler_params(blocks.num_warps_dkv, blocks.num_stages_dkv),
        interpret=config.interpret,
        name="kiln_flash_attention_dkv",
    )(*inputs)


def _backward_dq_kernel(
    q_ref, k_ref, v_ref, segment_ids_ref, d_out_ref, lse_ref, delta_ref, dq_ref, *, config
):
    block_q, block_kv = config.block_sizes.block_q_dq, config.block_sizes.block_kv_dq
    q_start = pl.program_id(0) * block_q
    q, d_out = q_ref[...], d_out_ref[...]
    lse, delta = lse_ref[...], delta_ref[...]
    q_positions = q_start + jnp.arange(block_q)
    q_segments = _segments(segment_ids_ref, q_start, block_q)

    def visit_kv_tile(kv_tile, dq, on_diagonal):
        kv_start = kv_tile * block_kv
        kv_slice = pl.ds(kv_start, block_kv)
        k = k_ref[kv_slice, :]
        logits = _scaled_logits(
            config,
            q,
            k,
            q_positions,
            kv_start + jnp.arange(block_kv),
            q_segments,
            _segments(segment_ids_ref, kv_start, block_kv),
            on_diagonal,
        )
        probs = jnp.exp2(logits - lse[:, None])
        d_probs = _dot(d_out, v_ref[kv_slice, :].T)
        d_logits = probs * (d_probs - delta[:, None])
        return dq + _dot(d_logits.astype(k.dtype), k)

    ranges = _kv_tile_ranges(config, q_start, block_q, block_kv)
    dq = _loop_over_tiles(ranges, visit_kv_tile, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (dq * config.sm_scale).astype(dq_ref.dtype)


def _backward_dq(q, k, v, segment_ids, d_out, lse, delta, config: _KernelConfig):
    batch, padded_len, num_heads, _ = q.shape
    blocks = config.block_sizes
    q_tile, kv_whole, row_stats_tile = _q_tile_specs(q.shape, k.shape[2], blocks.block_q_dq)
    return pl.pallas_call(
        functools.partial(_backward_dq_kernel, config=config),
        grid=(padded_len // blocks.block_q_dq, batch, num_heads),
        in_specs=[
            q_tile,
            kv_whole,
            kv_whole,
            None if segment_ids is None else _segment_spec(padded_len),
            q_tile,
            row_stats_tile,
            row_stats_tile,
        ],
        out_specs=q_tile,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=_compiler_params(blocks.num_warps_dq, blocks.num_stages_dq),
        interpret=config.interpret,
        name="kiln_flash_attention_dq",
    )(q, k, v, segment_ids, d_out, lse, delta)
