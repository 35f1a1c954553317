"""Kiln's Pallas flash attention against the device's anchors: error first, then speed.

    PYTHONPATH=src/python python3 benchmarks/attention.py            # full sweep (GPU)
    PYTHONPATH=src/python python3 benchmarks/attention.py --quick    # tiny sizes, CPU interpret mode
    PYTHONPATH=src/python python3 benchmarks/attention.py --layouts docs --seqs 2048 4096
    PYTHONPATH=src/python python3 benchmarks/attention.py --tune --groups 1 4   # TPU

On a GPU the others are XLA and cuDNN (the anchor); on a TPU jax's splash attention (the anchor)
and pallas.ops.tpu.flash_attention (benchmarks/tpu_attention.py). With --tune (TPU), the tiles
of ours and of splash are first chosen by measurement at --tune-seq on the none and docs layouts
(forward tiles, then backward tiles with the best forward; splash's candidates whole), each
candidate's time printed, and the sweep uses the winners (--json records them).

For every config it checks each implementation's output (and, for fwd+bwd, dQ/dK/dV) against
reference_attention in fp32 on one batch row and one kv-head group, then times forward and
forward+backward (jit, two warm-up calls). Segment layouts (benchmarks/segment_layouts.py): none,
ones (one document per row) and docs (the quickstart corpus's documents packed into windows, as
training sees them). With segment ids ours compares them per tile and skips tile pairs across
documents, XLA takes a dense boolean mask, and cuDNN its own packed layout (q/kv offsets and
lengths per document; kiln.model.attention.cudnn_packed_attention). FLOPs: forward
4*batch*heads*seq^2*dim, halved when causal, whatever the layout (the same count for every
layout, so times compare); forward+backward counts 3.5x forward (the backward does 5 of the 7
matmuls). Needs jax and src/python only: runs on the device image without a kiln install.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import statistics
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import tpu_attention  # benchmarks/tpu_attention.py
from segment_layouts import LAYOUTS, describe, segment_ids  # benchmarks/segment_layouts.py

from kiln.artifacts.atomic import atomic_write_json
from kiln.kernels.block_sizes import BlockSizes, LaunchParams, default_block_sizes
from kiln.kernels.flash_attention import flash_attention
from kiln.kernels.reference import reference_attention
from kiln.model.attention import cudnn_packed_attention, cudnn_packed_layout

IMPLEMENTATIONS = {"gpu": ("ours", "xla", "cudnn"), "tpu": ("ours", "splash", "jax_flash")}
ANCHORS = {"gpu": "cudnn", "tpu": "splash"}
PASSES = ("fwd", "fwd+bwd")
BACKWARD_FLOPS_FACTOR = 3.5
DTYPES = {"bf16": jnp.bfloat16, "fp32": jnp.float32}


@dataclasses.dataclass(frozen=True)
class Config:
    seq_len: int
    head_dim: int
    causal: bool
    batch: int
    num_heads: int
    num_kv_heads: int
    layout: str = "none"

    def forward_flops(self) -> float:
        flops = 4.0 * self.batch * self.num_heads * self.seq_len**2 * self.head_dim
        return flops / 2 if self.causal else flops


@dataclasses.dataclass(frozen=True)
class Measurement:
    """One implementation on one config and pass; None where it failed or does not apply."""

    implementation: str
    seconds: float | None
    error: float | None
    note: str = ""


def platform() -> str:
    """The platform whose implementations are compared: CPU runs the GPU's list (interpret)."""
    return "tpu" if jax.default_backend() == "tpu" else "gpu"


def attention(
    implementation: str,
    causal: bool,
    settings: tuple[BlockSizes, LaunchParams] | None = None,
    max_segments: int = 1,
    splash_candidate: tuple = tpu_attention.SPLASH_CANDIDATES[0],
) -> Callable[..., jax.Array]:
    """implementation's attention(q, k, v, segment_ids or None); ours with `settings` (None: the
    table's); cuDNN's packed layout sized for max_segments documents per row; splash's tiles."""
    if implementation == "splash":
        return tpu_attention.splash_attention(causal, splash_candidate)
    if implementation == "jax_flash":
        return tpu_attention.jax_flash_attention(causal)
    if implementation == "ours":
        block_sizes, launch = settings or (None, None)
        return lambda q, k, v, ids: flash_attention(
            q, k, v, ids, causal=causal, block_sizes=block_sizes, launch=launch
        )
    if implementation == "cudnn":
        return lambda q, k, v, ids: (
            jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")
            if ids is None
            else cudnn_packed_attention(
                q, k, v, *cudnn_packed_layout(ids, max_segments)[:2], causal=causal
            )
        )
    return lambda q, k, v, ids: jax.nn.dot_product_attention(
        q, k, v, mask=None if ids is None else ids[:, None, :, None] == ids[:, None, None, :],
        is_causal=causal, implementation=implementation,
    )  # fmt: skip


def as_pass(fn: Callable[..., jax.Array], pass_name: str) -> Callable[..., object]:
    """The jitted function a pass times, of (q, k, v, d_out, segment_ids): the output, or
    dQ/dK/dV for a cotangent d_out."""
    if pass_name == "fwd":
        return jax.jit(lambda q, k, v, d_out, ids: fn(q, k, v, ids))

    def loss(q, k, v, d_out, ids):
        return jnp.sum(fn(q, k, v, ids).astype(jnp.float32) * d_out.astype(jnp.float32))

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def relative_error(actual: jax.Array, expected: jax.Array) -> float:
    """max |actual - expected| / max |expected|; inf when anything is not finite."""
    actual, expected = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
    if not np.all(np.isfinite(actual)):
        return math.inf
    return float(np.max(np.abs(actual - expected)) / np.max(np.abs(expected)))


def check_error(result, reference, config: Config) -> float:
    """Largest relative error over the outputs, restricted to batch row 0 and kv head 0's group."""
    group = config.num_heads // config.num_kv_heads
    results = result if isinstance(result, tuple) else (result,)
    references = reference if isinstance(reference, tuple) else (reference,)
    # out and dq carry q heads; dk, dv carry kv heads.
    head_counts = (group,) if len(results) == 1 else (group, 1, 1)
    return max(
        relative_error(actual[:1, :, :heads], expected)
        for actual, expected, heads in zip(results, references, head_counts)
    )


def reference_on_slice(q, k, v, d_out, ids, config: Config, pass_name: str):
    """fp32 reference on batch row 0 and kv head 0 (rows and kv groups are independent)."""
    group = config.num_heads // config.num_kv_heads
    q, d_out = q[:1, :, :group].astype(jnp.float32), d_out[:1, :, :group].astype(jnp.float32)
    k, v = k[:1, :, :1].astype(jnp.float32), v[:1, :, :1].astype(jnp.float32)
    ids = None if ids is None else ids[:1]

    def fn(q, k, v, ids):
        return reference_attention(q, k, v, ids, causal=config.causal)

    with jax.default_matmul_precision("highest"):  # a TPU's default would round to bf16
        return as_pass(fn, pass_name)(q, k, v, d_out, ids)


def device_seconds(fn: Callable, args: tuple, iters: int, repeats: int = 3) -> float:
    """Median over `repeats` of (iters calls queued back to back) / iters: device throughput
    without a host round trip per call. The first two calls compile and warm up."""
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - start) / iters)
    return statistics.median(samples)


def measure(
    implementation: str, config: Config, pass_name: str, args: tuple, reference, options
) -> Measurement:
    if implementation == "cudnn" and jax.default_backend() != "gpu":
        return Measurement(implementation, None, None, "n/a")
    settings = ours_settings(options, config.head_dim)
    splash = splash_tiles(options, config.head_dim)
    ids = args[-1]
    # cuDNN's packed layout at its tightest for this batch: its most documents in a row.
    max_segments = 1 if ids is None else int((ids[:, 1:] != ids[:, :-1]).sum(axis=1).max()) + 1
    fn = as_pass(
        attention(implementation, config.causal, settings, max_segments, splash), pass_name
    )
    try:
        error = check_error(fn(*args), reference, config)
        seconds = device_seconds(fn, args, options.iters)
    except Exception as exc:  # noqa: BLE001 - a failing baseline (OOM, unsupported) is a table cell
        print(
            f"  {implementation} {pass_name} {config}: {type(exc).__name__}: {exc}"[:400],
            file=sys.stderr,
        )
        return Measurement(implementation, None, None, "fail")
    return Measurement(implementation, seconds, error)


def make_inputs(config: Config, dtype, seed: int = 0) -> tuple[jax.Array | None, ...]:
    """(q, k, v, d_out, segment_ids or None) on the device."""
    keys = jax.random.split(jax.random.PRNGKey(seed), 4)
    q_shape = (config.batch, config.seq_len, config.num_heads, config.head_dim)
    kv_shape = (config.batch, config.seq_len, config.num_kv_heads, config.head_dim)
    ids = segment_ids(config.layout, config.batch, config.seq_len, seed)
    return (
        jax.random.normal(keys[0], q_shape, dtype),
        jax.random.normal(keys[1], kv_shape, dtype),
        jax.random.normal(keys[2], kv_shape, dtype),
        jax.random.normal(keys[3], q_shape, dtype),
        None if ids is None else jnp.asarray(ids),
    )


def sweep(options) -> list[Config]:
    configs = []
    for seq_len in options.seqs:
        for head_dim in options.head_dims:
            num_heads = options.num_heads or max(1, options.model_dim // head_dim)
            for group in options.groups:
                for causal in options.causal:
                    for layout in options.layouts:
                        configs.append(
                            Config(
                                seq_len=seq_len,
                                head_dim=head_dim,
                                causal=causal,
                                batch=max(1, options.tokens // seq_len),
                                num_heads=num_heads,
                                num_kv_heads=num_heads // group,
                                layout=layout,
                            )
                        )
    return configs


def format_cell(measurement: Measurement, flops: float) -> tuple[str, str]:
    if measurement.seconds is None:
        return measurement.note, measurement.note
    return f"{flops / measurement.seconds / 1e12:.3g}", f"{measurement.error:.1e}"


def header() -> str:
    names = IMPLEMENTATIONS[platform()]
    return (
        f"{'seq':>6} {'dim':>4} {'gqa':>4} {'causal':>6} {'layout':>6} {'pass':>8} {'ours ms':>9} "
        + " ".join(f"{name + ' TF/s':>14}" for name in names)
        + f" {'ours/' + ANCHORS[platform()]:>12} "
        + " ".join(f"{name + ' err':>13}" for name in names)
    )


def table_row(config: Config, pass_name: str, measurements: list[Measurement]) -> str:
    """The row's TF/s and errors; ours/anchor is the anchor's time over ours (> 1: ours is
    faster)."""
    flops = config.forward_flops() * (BACKWARD_FLOPS_FACTOR if pass_name == "fwd+bwd" else 1)
    cells = [format_cell(m, flops) for m in measurements]
    ours = measurements[0]
    anchor = measurements[IMPLEMENTATIONS[platform()].index(ANCHORS[platform()])]
    ratio = "n/a"
    if ours.seconds is not None and anchor.seconds is not None:
        ratio = f"{anchor.seconds / ours.seconds:.2f}"
    ours_ms = "fail" if ours.seconds is None else f"{ours.seconds * 1e3:.3f}"
    gqa = f"{config.num_heads // config.num_kv_heads}:1"
    return (
        f"{config.seq_len:>6} {config.head_dim:>4} {gqa:>4} {config.causal!s:>6} "
        f"{config.layout:>6} {pass_name:>8} {ours_ms:>9} "
        + " ".join(f"{tflops:>14}" for tflops, _ in cells)
        + f" {ratio:>12} "
        + " ".join(f"{error:>13}" for _, error in cells)
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (CPU smoke run)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--seqs", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[128, 64])
    parser.add_argument(
        "--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS), help="segment layouts"
    )
    parser.add_argument(
        "--causal", nargs="+", choices=["true", "false"], default=["true", "false"]
    )
    parser.add_argument("--model-dim", type=int, default=2048, help="heads = model_dim / head_dim")
    parser.add_argument("--num-heads", type=int, default=0, help="overrides --model-dim")
    parser.add_argument(
        "--groups", type=int, nargs="+", default=[1], help="q heads per kv head (GQA), each"
    )
    parser.add_argument(
        "--tune",
        action="store_true",
        help="TPU: choose ours' and splash's tiles by measurement first (module docstring)",
    )
    parser.add_argument("--tune-seq", type=int, default=4096)
    parser.add_argument(
        "--tune-json",
        help="write the tuned tiles here: a settings file for --block-sizes, splash's under "
        '"splash"',
    )
    parser.add_argument("--tokens", type=int, default=16384, help="batch = tokens / seq")
    parser.add_argument("--iters", type=int, default=10, help="calls per timed sample (3 samples)")
    parser.add_argument(
        "--block-sizes",
        help="JSON {head_dim: BlockSizes and LaunchParams fields} (a tuner's --json) instead of "
        "the table",
    )
    parser.add_argument("--json", help="also write the rows to this JSON file (after each row)")
    options = parser.parse_args(argv)
    if options.quick:
        options.seqs, options.head_dims, options.num_heads = [128], [64], 2
        options.tokens, options.iters = 256, 2
    options.causal = [value == "true" for value in options.causal]
    options.splash_blocks = load_splash_tiles(options.block_sizes)
    options.block_sizes = load_block_sizes(options.block_sizes)
    return options


def load_splash_tiles(path: str | None) -> dict[int, tuple]:
    """{head_dim: splash candidate} from a settings file's "splash" entry (--tune-json's)."""
    if path is None:
        return {}
    with open(path) as file:
        entries = json.load(file).get("splash", {})
    return {int(dim): tuple(candidate) for dim, candidate in entries.items()}


def write_tuned(path: str, options) -> None:
    settings: dict = {
        str(dim): {**dataclasses.asdict(blocks), **dataclasses.asdict(launch)}
        for dim, (blocks, launch) in options.block_sizes.items()
    }
    settings["splash"] = {str(dim): list(c) for dim, c in options.splash_blocks.items()}
    atomic_write_json(path, settings)


def load_block_sizes(path: str | None) -> dict[int, tuple[BlockSizes, LaunchParams]]:
    """{head_dim: (BlockSizes, LaunchParams)} from a settings file: {head_dim: their fields in
    one dict} (other top-level keys, such as the tuner's device_kind, are not head dims)."""
    if path is None:
        return {}
    with open(path) as file:
        entries = json.load(file)
    try:
        return {
            int(dim): settings_from_fields(fields)
            for dim, fields in entries.items()
            if dim.isdigit()
        }
    except ValueError as error:
        raise ValueError(f"--block-sizes {path}: {error}") from None


def settings_from_fields(fields: dict) -> tuple[BlockSizes, LaunchParams]:
    """BlockSizes and LaunchParams from one dict of their fields; another name is a ValueError."""
    tiles = {field.name for field in dataclasses.fields(BlockSizes)}
    launch = {field.name for field in dataclasses.fields(LaunchParams)}
    unknown = sorted(set(fields) - tiles - launch)
    if unknown:
        raise ValueError(
            f"{', '.join(unknown)}: not a BlockSizes or LaunchParams field (the product runs the "
            "Triton kernels; a lab kernel's switch belongs to kiln_lab's tools)"
        )
    return (
        BlockSizes(**{name: value for name, value in fields.items() if name in tiles}),
        LaunchParams(**{name: value for name, value in fields.items() if name in launch}),
    )


def matmul_tflops(size: int = 8192) -> float:
    """A bf16 size^3 matrix product on random data: the device's arithmetic ceiling, this run."""
    a, b = (
        jax.random.normal(key, (size, size), jnp.bfloat16)
        for key in jax.random.split(jax.random.PRNGKey(1))
    )
    seconds = device_seconds(jax.jit(jnp.matmul), (a, b), iters=10)
    return 2.0 * size**3 / seconds / 1e12


def tune(options) -> None:
    """Chooses ours' and splash's tiles per head dim by measurement at --tune-seq (causal, layouts
    none and docs, no GQA), printing each candidate's summed time: ours' forward tiles by the
    forward's time, then its backward tiles by forward+backward's; splash's whole by
    forward+backward's. Sets options.block_sizes and options.splash_blocks."""
    for head_dim in options.head_dims:
        num_heads = options.num_heads or max(1, options.model_dim // head_dim)
        batch = max(1, options.tokens // options.tune_seq)
        configs = [
            Config(options.tune_seq, head_dim, True, batch, num_heads, num_heads, layout)
            for layout in ("none", "docs")
        ]
        inputs = [make_inputs(config, DTYPES[options.dtype]) for config in configs]
        seconds = functools.partial(summed_seconds, configs, inputs, options.iters)
        settings, splash = tuned_tiles(f"d={head_dim}", seconds)
        options.block_sizes[head_dim] = settings
        options.splash_blocks[head_dim] = splash


def tuned_tiles(what: str, seconds: Callable) -> tuple[tuple[BlockSizes, LaunchParams], tuple]:
    """(ours' best settings, splash's best candidate), with seconds(fn_of_config, pass_name)."""

    def ours(settings: tuple[BlockSizes, LaunchParams]) -> Callable:
        return lambda config: attention("ours", True, settings)

    def splash(candidate: tuple) -> Callable:
        return lambda config: attention("splash", True, splash_candidate=candidate)

    forward, _ = best_of(
        f"ours fwd {what}", tpu_attention.ours_candidates(None),
        lambda settings: seconds(ours(settings), "fwd"),
    )  # fmt: skip
    settings = best_of(
        f"ours fwd+bwd {what}", tpu_attention.ours_candidates(forward),
        lambda settings: seconds(ours(settings), "fwd+bwd"),
    )  # fmt: skip
    splash_tiles = best_of(
        f"splash fwd+bwd {what}", tpu_attention.SPLASH_CANDIDATES,
        lambda candidate: seconds(splash(candidate), "fwd+bwd"),
    )  # fmt: skip
    return settings, splash_tiles


def ours_settings(options, head_dim: int) -> tuple[BlockSizes, LaunchParams] | None:
    """Ours' settings for a head dim from --block-sizes or --tune (the largest head dim's when
    it has none, as the kernel table does); None: the table's."""
    settings = options.block_sizes
    return settings.get(head_dim, settings[max(settings)]) if settings else None


def splash_tiles(options, head_dim: int) -> tuple:
    """Splash's tiles for a head dim: tuned or loaded for it, else for the largest head dim
    given (as the kernel table does), else its first candidate."""
    tiles = options.splash_blocks
    if not tiles:
        return tpu_attention.SPLASH_CANDIDATES[0]
    return tiles.get(head_dim, tiles[max(tiles)])


def summed_seconds(
    configs: list[Config], inputs: list, iters: int, fn_of_config: Callable, pass_name: str
) -> float:
    """The pass's device seconds summed over the configs (their inputs given)."""
    return sum(
        device_seconds(as_pass(fn_of_config(config), pass_name), args, iters)
        for config, args in zip(configs, inputs)
    )


def best_of(what: str, candidates: list, seconds_of: Callable):
    """The candidate with the least seconds_of(candidate); each printed, failures included."""
    timed = []
    for candidate in candidates:
        name = tpu_attention.describe(candidate)
        try:
            timed.append((seconds_of(candidate), candidate))
            print(f"  tune {what}: {name}: {timed[-1][0] * 1e3:.3f} ms", flush=True)
        except Exception as exc:  # noqa: BLE001 - a candidate that does not fit is skipped
            print(f"  tune {what}: {name}: {type(exc).__name__}: {exc}"[:300], flush=True)
    if not timed:
        raise RuntimeError(f"tune {what}: every candidate failed")
    best = min(timed, key=lambda pair: pair[0])[1]
    print(f"  tune {what}: best {tpu_attention.describe(best)}", flush=True)
    return best


def main(argv: list[str] | None = None) -> None:
    options = parse_args(argv)
    device = jax.devices()[0]
    print(
        f"jax {jax.__version__} on {device.platform}: {device.device_kind}; dtype {options.dtype}"
    )
    if device.platform in ("gpu", "tpu"):
        print(f"  bf16 8192^3 matmul (ceiling, this run): {matmul_tflops():.0f} TF/s")
    if options.tune:
        tune(options)
        if options.tune_json:
            write_tuned(options.tune_json, options)
    for head_dim in options.head_dims:
        lowering = "mosaic" if platform() == "tpu" else "triton"
        blocks, launch = ours_settings(options, head_dim) or default_block_sizes(
            device.device_kind, head_dim, lowering
        )
        print(f"  settings (d={head_dim}): {blocks} {launch}")
        if platform() == "tpu":
            print(f"  splash tiles (d={head_dim}): {splash_tiles(options, head_dim)}")
    for layout in options.layouts:
        for seq_len in options.seqs:
            batch = max(1, options.tokens // seq_len)
            print(f"  {layout} at seq {seq_len}: {describe(segment_ids(layout, batch, seq_len))}")
    print(header())
    rows = []
    for config in sweep(options):
        args = make_inputs(config, DTYPES[options.dtype])
        for pass_name in PASSES:
            reference = reference_on_slice(*args, config, pass_name)
            measurements = [
                measure(name, config, pass_name, args, reference, options)
                for name in IMPLEMENTATIONS[platform()]
            ]
            print(table_row(config, pass_name, measurements), flush=True)
            settings = ours_settings(options, config.head_dim)
            rows.append(
                {
                    "config": dataclasses.asdict(config),
                    "pass": pass_name,
                    "dtype": options.dtype,
                    "device_kind": device.device_kind,
                    "jax": jax.__version__,
                    "ours_settings": None
                    if settings is None
                    else {**dataclasses.asdict(settings[0]), **dataclasses.asdict(settings[1])},
                    "splash_tiles": splash_tiles(options, config.head_dim),
                    "results": [dataclasses.asdict(m) for m in measurements],
                }
            )
            if options.json:
                atomic_write_json(options.json, rows)


if __name__ == "__main__":
    main()
