"""Tunes the flash-attention kernels' settings on the device: each kernel on its own.

    PYTHONPATH=src/python:benchmarks:lab python3 -m kiln_lab.attention_tune --json tuned.json
    PYTHONPATH=src/python:benchmarks:lab python3 -m kiln_lab.attention_tune --quick  # CPU smoke

For each head dim it times the forward, dK/dV and dQ kernels separately over a list of candidate
(block sizes, warps, stages), at one problem (default: causal, seq 4096, bf16, 16k tokens), then the
alternatives of a layout against what they replace: each Hopper (Mosaic GPU) kernel against its
Triton one (each Hopper kernel in its own process with a time limit, since none has run on a device
yet), and the fused-dQ backward against the faster dK/dV + dQ. Each candidate's outputs are checked
against the fp32 reference on the first and last batch rows' first and last heads before it is
timed; a candidate that fails to compile (shared memory, registers) or whose error is over
--max-error is dropped (its row names the outputs off and the 64-row tiles they are off in). Prints
one row per candidate and, per head dim, the winning settings: BlockSizes and LaunchParams fields
(the entry to put in kiln.kernels.block_sizes.TUNED_BLOCK_SIZES), and the HopperKernels switches
(hopper_forward, hopper_dkv, hopper_dq, hopper_fused_fp32_probs) that are on. --json gets them as
one flat dict per head dim, rewritten after every kernel so a run stopped early keeps what it
found; without a Hopper switch on, benchmarks/attention.py --block-sizes reads it. Context rows
time cuDNN, jax's Triton `mha` and jax's Mosaic GPU `attention_mgpu` (on fp16 copies of the
inputs) on the same problem.

Reaches into the product's private kernel functions on purpose: tuning is per kernel.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from attention import (  # benchmarks/attention.py
    BACKWARD_FLOPS_FACTOR,
    PASSES,
    as_pass,
    attention,
    device_seconds,
    relative_error,
)

from kiln.artifacts.atomic import atomic_write_json
from kiln.kernels import triton_attention
from kiln.kernels.block_sizes import default_block_sizes
from kiln.kernels.reference import reference_attention
from kiln_lab.flash_attention_hopper import hopper_forward
from kiln_lab.flash_attention_hopper_dkv import hopper_dkv
from kiln_lab.flash_attention_hopper_dq import hopper_dq
from kiln_lab.hopper_attention import LabConfig, flash_attention, lab_config
from kiln_lab.layouts import (
    CANDIDATES,
    CHOSEN_FIELDS,
    FIELDS,
    HOPPER_ALTERNATIVE,
    LAYOUT,
    MATMULS,
    OUTPUTS,
    TRITON_KERNELS,
    Fields,
    fields_of,
    settings,
    switched_on,
)

# Rows per tile where a rejected candidate's error is located: a wgmma's rows, the smallest tile
# of any kernel's candidates here.
TILE_ROWS = 64

@dataclasses.dataclass(frozen=True)
class Problem:
    seq_len: int
    head_dim: int
    causal: bool
    batch: int
    num_heads: int

    def matmul_flops(self, kernel: str) -> float:
        flops = (
            2.0 * MATMULS[kernel] * self.batch * self.num_heads * self.seq_len**2 * self.head_dim
        )
        return flops / 2 if self.causal else flops


class KernelBench:
    """Inputs, residuals and fp32 references for one problem; builds and checks each kernel."""

    def __init__(self, problem: Problem, dtype, interpret: bool):
        self.problem, self.interpret = problem, interpret
        keys = jax.random.split(jax.random.PRNGKey(int(time.time())), 4)  # fresh every run
        shape = (problem.batch, problem.seq_len, problem.num_heads, problem.head_dim)
        self.q, self.k, self.v, self.d_out = (jax.random.normal(key, shape, dtype) for key in keys)
        base = self.config(fields_of(*default_block_sizes("", problem.head_dim)))
        self.out, self.lse = jax.jit(lambda q, k, v: triton_attention.forward(q, k, v, None, base.triton))(
            self.q, self.k, self.v
        )
        self.delta = jnp.einsum(
            "bthd,bthd->bht", self.out.astype(jnp.float32), self.d_out.astype(jnp.float32)
        )
        self.expected = self._references()

    def config(self, fields: Fields) -> LabConfig:
        problem = self.problem
        block_sizes, launch, hopper = settings(fields)
        config = lab_config(
            problem.seq_len,
            self.q.dtype,
            causal=problem.causal,
            sm_scale=1.0 / math.sqrt(problem.head_dim),
            block_sizes=block_sizes,
            launch=launch,
            hopper=hopper,
            interpret=self.interpret,
        )
        assert config.triton.padded_len == problem.seq_len, "pick a seq_len the tiles divide"
        return config

    def _references(self) -> dict[str, tuple]:
        q, k, v, d_out = (
            checked(x).astype(jnp.float32) for x in (self.q, self.k, self.v, self.d_out)
        )
        causal = self.problem.causal
        out, vjp = jax.vjp(lambda q, k, v: reference_attention(q, k, v, causal=causal), q, k, v)
        dq, dk, dv = vjp(d_out)
        sm_scale = 1.0 / math.sqrt(self.problem.head_dim)  # the fused kernel's dQ is unscaled
        return {
            "fwd": (out,),
            "hopper": (out,),
            "dkv": (dk, dv),
            "hopper_dkv": (dk, dv),
            "dq": (dq,),
            "hopper_dq": (dq,),
            "fused": (dq / sm_scale, dk, dv),
            "hopper_fused": (dq / sm_scale, dk, dv),
        }

    def kernel(self, name: str, fields: Fields) -> tuple[Callable, tuple]:
        config = self.config(fields)
        if name == "hopper":
            forward = functools.partial(hopper_forward, config=config.forward)
            return jax.jit(lambda q, k, v: forward(q, k, v, None)[0]), (
                self.q,
                self.k,
                self.v,
            )
        if name == "fwd":
            return jax.jit(lambda q, k, v: triton_attention.forward(q, k, v, None, config.triton)[0]), (
                self.q,
                self.k,
                self.v,
            )
        if name in ("hopper_dkv", "hopper_fused", "hopper_dq"):
            hopper_kernel, hopper_config = (
                (hopper_dq, config.dq) if name == "hopper_dq" else (hopper_dkv, config.dkv)
            )
            fn = jax.jit(lambda *args: hopper_kernel(*args[:3], None, *args[3:], hopper_config))
        else:
            body = {
                "dkv": triton_attention._backward_dkv,
                "fused": triton_attention._backward_dkv,
                "dq": triton_attention._backward_dq,
            }[name]
            fn = jax.jit(lambda *args: body(*args[:3], None, *args[3:], config.triton))
        return fn, (self.q, self.k, self.v, self.d_out, self.lse, self.delta)

    def compared(self, name: str, result):
        """(output, the kernel's value, its fp32 reference on the checked slices) per output."""
        results = result if isinstance(result, (tuple, list)) else (result,)
        return zip(OUTPUTS[name], results, self.expected[name])

    def errors(self, name: str, result) -> dict[str, float]:
        """Each output's relative error against the fp32 reference, on the checked slices."""
        return {
            output: relative_error(checked(actual), expected)
            for output, actual, expected in self.compared(name, result)
        }

    def off_tiles(self, name: str, result, cap: float) -> dict[str, str]:
        """Where each output over cap is off: per checked slice, its 64-row tiles along the
        sequence whose max error, over the slice's max |reference|, passes cap. A pattern
        (every other tile, the last one, all) points at the line of the kernel to read."""
        found = {}
        for output, actual, expected in self.compared(name, result):
            where = off_slices(np.asarray(checked(actual), np.float32), np.asarray(expected), cap)
            if where:
                found[output] = where
        return found


def off_slices(actual: np.ndarray, expected: np.ndarray, cap: float) -> str:
    """off_tiles for one output, as "[batch,head] tiles" for each checked slice that has any
    ([0,-1]: the first batch row's last head), "" when none."""
    parts, ends = [], ("0", "-1")
    count = -(-actual.shape[1] // TILE_ROWS)
    for b, h in np.ndindex(actual.shape[0], actual.shape[2]):
        scale = np.max(np.abs(expected[b, :, h]))
        diff = np.abs(actual[b, :, h] - expected[b, :, h])
        tiles = [
            tile
            for tile in range(count)
            if not np.max(diff[tile * TILE_ROWS : (tile + 1) * TILE_ROWS]) / scale <= cap
        ]
        if tiles:
            parts.append(f"[{ends[b]},{ends[h]}] {spans(tiles)} of {count}")
    return "; ".join(parts)


def spans(numbers: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> "0-2,5,7-8"."""
    runs: list[list[int]] = []
    for n in numbers:
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)


def checked(x: jax.Array) -> jax.Array:
    """The first and last batch rows' first and last heads: indexing that goes wrong beyond
    the first program shows there too."""
    ends = jnp.array([0, -1])
    return x[ends][:, :, ends]


def failure(exc: Exception, head: int = 300, tail: int = 700) -> str:
    """The exception on one line: its start, and its end, where compilers put their verdict
    (ptxas' error after Mosaic GPU's long context)."""
    text = f"{type(exc).__name__}: {exc}".replace("\n", " | ")
    return text if len(text) <= head + tail else f"{text[:head]} ... {text[-tail:]}"


def ordered_candidates(base: Fields, kernel: str, candidates) -> list[tuple[int, ...]]:
    """The current setting first (the one to beat), then the others. For a Hopper kernel when
    base runs the Triton one, the list alone: those fields rarely suit the Mosaic kernel."""
    switches = [f for f, on in LAYOUT[kernel].items() if f.startswith("hopper") and on]
    if not all(base.get(switch, False) for switch in switches):
        return list(candidates)
    current = tuple(base[field] for field in FIELDS[kernel])
    return [current] + [c for c in candidates if c != current]


def tune_kernel(
    bench: KernelBench,
    kernel: str,
    base: Fields,
    options,
    candidates=None,
    on_best: Callable[[Fields, float], None] | None = None,
) -> tuple[Fields, float]:
    """The fastest candidate for one kernel (other fields kept from base) within the error cap,
    and its seconds (inf when none passed: then base comes back). on_best hears of each new
    fastest as it is found."""
    best, best_seconds = base, math.inf
    candidates = CANDIDATES[kernel] if candidates is None else candidates
    limit = options.max_candidates
    if kernel in TRITON_KERNELS:
        limit = min(limit, options.triton_candidates)
    for candidate in ordered_candidates(base, kernel, candidates)[:limit]:
        label = ",".join(map(str, candidate))
        # The row's start goes out first: a kernel that hangs the device leaves its name last.
        print(f"  {kernel:<10} {label:<16}", end="", flush=True)
        try:
            fields = {**base, **dict(zip(FIELDS[kernel], candidate)), **LAYOUT[kernel]}
            fn, args = bench.kernel(kernel, fields)
            result = fn(*args)
            errors = bench.errors(kernel, result)
            seconds = device_seconds(fn, args, options.iters)
        except Exception as exc:  # noqa: BLE001 - out of shared memory etc.: drop the candidate
            print(f" failed: {failure(exc)}", flush=True)
            continue
        tflops = bench.problem.matmul_flops(kernel) / seconds / 1e12
        error = max(errors.values())
        verdict = ""
        if error > options.max_error:  # Which outputs are off, for whoever debugs the kernel.
            verdict = "rejected: " + ", ".join(f"{o} {e:.1e}" for o, e in errors.items())
        print(f" {seconds * 1e3:8.3f} ms {tflops:7.1f} TF/s err {error:.1e} {verdict}", flush=True)
        if verdict:  # And where they are off.
            for output, where in bench.off_tiles(kernel, result, options.max_error).items():
                print(f"    {output} off in [batch,head] {TILE_ROWS}-row tiles: {where}")
        if not verdict and seconds < best_seconds:
            best, best_seconds = fields, seconds
            if on_best is not None:
                on_best(best, best_seconds)
    return best, best_seconds


def tune_in_child(
    bench: KernelBench, kernel: str, base: Fields, options
) -> tuple[Fields, float]:
    """tune_kernel in a child process stopped after --stage-timeout seconds: a kernel never run
    on a device that hangs it, or breaks its CUDA context (an illegal address fails every later
    launch in the process), costs the rest of its own stage only: the child writes its fastest
    candidate as it finds one, and that is kept. It prints its rows to our stdout, builds its
    own inputs, and does not preallocate GPU memory (we hold most of it)."""
    with tempfile.TemporaryDirectory() as scratch:
        result = Path(scratch) / "result.json"
        argv = [sys.executable, "-m", __spec__.name, "--stage", kernel, "--result", str(result)]
        argv += ["--problem", json.dumps(dataclasses.asdict(bench.problem))]
        argv += ["--base", json.dumps(base)]
        argv += ["--iters", str(options.iters), "--max-error", str(options.max_error)]
        argv += ["--max-candidates", str(options.max_candidates)]
        env = os.environ | {
            "PYTHONPATH": os.pathsep.join(sys.path),
            "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
        }
        try:
            child = subprocess.run(argv, env=env, timeout=options.stage_timeout, check=False)
            ended = "" if child.returncode == 0 else f"its process exited with {child.returncode}"
        except subprocess.TimeoutExpired:  # The row it stopped in is the one above.
            ended = f"stopped after {options.stage_timeout:g} s"
        if not result.exists():
            print(f"\n  {kernel}: {ended}, no candidate passed before", flush=True)
            return base, math.inf
        if ended:  # Exit code: negative for the signal that ended it.
            print(f"\n  {kernel}: {ended}; its fastest so far is kept", flush=True)
        found = json.loads(result.read_text())
    return found["fields"], found["seconds"]


def run_stage(options) -> None:
    """The child's side of tune_in_child: one kernel's candidates; each new fastest goes to
    --result (none there: no candidate passed)."""
    problem = Problem(**json.loads(options.problem))
    interpret = jax.devices()[0].platform == "cpu"
    bench = KernelBench(problem, jnp.bfloat16, interpret)
    base = json.loads(options.base)

    def write(fields: Fields, seconds: float) -> None:
        found = {"fields": fields, "seconds": seconds}
        atomic_write_json(options.result, found)

    tune_kernel(bench, options.stage, base, options, on_best=write)


@dataclasses.dataclass
class Choice:
    """The fastest setting found so far for one kernel (its fields in CHOSEN_FIELDS)."""

    seconds: float
    fields: Fields

    def offer(self, fields: Fields, seconds: float) -> None:
        if seconds < self.seconds:
            self.seconds, self.fields = seconds, fields


def tune(bench: KernelBench, fields: Fields, options, on_update: Callable) -> Fields:
    """The Triton forward, dK/dV and dQ first, then the Triton fused-dQ backward; then each
    Hopper kernel against its Triton one, the faster winning (HOPPER_ALTERNATIVE's order; the
    fused one needs head dim 128); last, the faster fused backward against the chosen dK/dV +
    dQ. The Hopper kernels go last, each in a child process (tune_in_child): they are the ones
    never yet run on a device."""
    chosen = {}
    for kernel in ("fwd", "dkv", "dq"):
        fields, seconds = tune_kernel(bench, kernel, fields, options)
        chosen[kernel] = Choice(seconds, fields)
        on_update(fields)
    split = fields
    fields, seconds = tune_kernel(bench, "fused", split, options)
    chosen["fused"] = Choice(seconds, fields)

    def best_layout() -> tuple[Fields, float]:
        """The chosen kernels' fields on split, and the chosen dK/dV + dQ's seconds."""
        split_backward = chosen["dkv"].seconds + chosen["dq"].seconds
        kernels = ["fwd", "dkv", "dq"] + (
            ["fused"] if chosen["fused"].seconds < split_backward else []
        )
        layout = dict(split)
        for kernel in kernels:
            layout.update(
                {field: chosen[kernel].fields.get(field, False) for field in CHOSEN_FIELDS[kernel]}
            )
        return layout, split_backward

    on_update(best_layout()[0])
    for kernel, alternative in HOPPER_ALTERNATIVE.items():
        if alternative == "hopper_fused" and bench.problem.head_dim % 128:
            continue
        triton_seconds = chosen[kernel].seconds
        hopper, hopper_seconds = tune_in_child(bench, alternative, split, options)
        print(
            f"  {kernel}: triton {triton_seconds * 1e3:.3f} ms, hopper (mosaic gpu) "
            f"{hopper_seconds * 1e3:.3f} ms",
            flush=True,
        )
        chosen[kernel].offer(hopper, hopper_seconds)
        on_update(best_layout()[0])
    fields, split_backward = best_layout()
    print(
        f"  backward: dK/dV + dQ {split_backward * 1e3:.3f} ms, fused dQ "
        f"{chosen['fused'].seconds * 1e3:.3f} ms",
        flush=True,
    )
    return fields


def context_rows(bench: KernelBench, options) -> None:
    """jax's own kernels and cuDNN on the same problem, for scale, timed like attention.py's
    table (their failures are printed, not fatal). jax's Mosaic GPU kernel (FlashAttention-3's
    forward layout, as our Hopper forward) takes fp16 only: its inputs are cast before timing."""
    problem = bench.problem
    sm_scale = 1.0 / math.sqrt(problem.head_dim)
    args = (bench.q, bench.k, bench.v, bench.d_out)
    block_sizes, launch, hopper = settings(options.tuned)
    ours = functools.partial(
        flash_attention,
        causal=problem.causal,
        block_sizes=block_sizes,
        launch=launch,
        hopper=hopper,
    )
    runs = {
        "ours (tuned)": (ours, args),
        "cudnn": (attention("cudnn", problem.causal), args),
    }
    try:
        from jax.experimental.pallas.ops.gpu import attention as jax_triton

        runs["jax triton mha"] = (
            lambda q, k, v: jax_triton.mha(q, k, v, None, sm_scale=sm_scale, causal=problem.causal),
            args,
        )
    except ImportError as exc:
        print(f"  jax triton mha: {exc}")
    try:  # It imports jax's test utilities, which need absl (the device image has it).
        from jax.experimental.pallas.ops.gpu import attention_mgpu as jax_mosaic

        # Its backward takes no causal mask: that row fails for a causal problem.
        config = jax_mosaic.TuningConfig(
            block_q=64,
            block_kv=128,
            max_concurrent_steps=2,
            causal=problem.causal,
            block_q_dkv=64,
            block_kv_dkv=64,
            block_q_dq=64,
            block_kv_dq=64,
        )
        runs["jax mosaic gpu (fp16)"] = (
            lambda q, k, v: jax_mosaic.attention(q, k, v, config),
            tuple(x.astype(jnp.float16) for x in args),
        )
    except ImportError as exc:
        print(f"  jax mosaic gpu: {exc}")
    for name, (fn, run_args) in runs.items():
        for pass_name in PASSES:
            label = f"{name} {pass_name}"
            try:
                seconds = device_seconds(as_pass(fn, pass_name), run_args, options.iters)
            except Exception as exc:  # noqa: BLE001
                print(f"  {label:<30} failed: {failure(exc)}", flush=True)
                continue
            flops = problem.matmul_flops("fwd")
            flops *= BACKWARD_FLOPS_FACTOR if pass_name == "fwd+bwd" else 1.0
            print(f"  {label:<30} {seconds * 1e3:8.3f} ms {flops / seconds / 1e12:7.1f} TF/s")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, CPU interpret mode")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--head-dims", type=int, nargs="+", default=[128, 64])
    parser.add_argument("--non-causal", action="store_true")
    parser.add_argument("--tokens", type=int, default=16384, help="batch = tokens / seq")
    parser.add_argument("--model-dim", type=int, default=2048, help="heads = model_dim / head_dim")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--max-candidates", type=int, default=100)
    parser.add_argument(
        "--triton-candidates",
        type=int,
        default=100,
        help="at most this many per Triton kernel (1: time the table's setting, as a baseline)",
    )
    parser.add_argument("--max-error", type=float, default=5e-2, help="bf16 relative error cap")
    parser.add_argument("--json", help="write {head_dim: the winning Fields} here")
    parser.add_argument(
        "--stage-timeout",
        type=float,
        default=45.0,
        help="seconds each Hopper kernel's stage (its own process) may take",
    )
    # A Hopper stage's process (tune_in_child): its kernel, problem, base layout and result file.
    parser.add_argument("--stage", choices=CANDIDATES, help=argparse.SUPPRESS)
    parser.add_argument("--problem", help=argparse.SUPPRESS)
    parser.add_argument("--base", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    if options.quick:
        options.seq_len, options.head_dims, options.tokens, options.model_dim = 128, [64], 128, 128
        options.iters, options.max_candidates = 1, 2
    return options


def main(argv: list[str] | None = None) -> None:
    options = parse_args(argv)
    if options.stage:
        run_stage(options)
        return
    device = jax.devices()[0]
    interpret = device.platform == "cpu"
    print(f"jax {jax.__version__} on {device.platform}: {device.device_kind}")
    tuned: dict[str, dict] = {}
    for head_dim in options.head_dims:
        problem = Problem(
            seq_len=options.seq_len,
            head_dim=head_dim,
            causal=not options.non_causal,
            batch=max(1, options.tokens // options.seq_len),
            num_heads=max(1, options.model_dim // head_dim),
        )
        print(f"{problem} (bf16)", flush=True)
        bench = KernelBench(problem, jnp.bfloat16, interpret)
        fields = fields_of(*default_block_sizes(device.device_kind, head_dim))

        def record(fields: Fields, head_dim: int = head_dim) -> None:
            tuned[str(head_dim)] = switched_on(fields)
            if options.json:
                atomic_write_json(options.json, {"device_kind": device.device_kind, **tuned})

        fields = tune(bench, fields, options, record)
        print(f"  tuned d={head_dim}: {switched_on(fields)}", flush=True)
        if not interpret:
            options.tuned = fields
            context_rows(bench, options)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
