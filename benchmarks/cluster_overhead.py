"""What a Ray cluster costs a small run: the same tiny step trained here and as a cluster job.

    ./pants run benchmarks/cluster_overhead.py -- [--steps 40] [--repeat 1]

The step is the tests' tiny model (kiln_testing.steps, ci_tiny's size) on one host with two jax
CPU devices. "here" is `python -m kiln.runner STEP --prefix P`; "cluster" adds `--cluster` with a
two-node Ray cluster on loopback (kiln_testing.ray_cluster, one CPU each), so the job's driver,
the Ray Client session and the host actor all run on this machine. Per run:

- submission to first step: from starting the runner to the first line of metrics.jsonl (both
  include jax's compile; the cluster run adds connecting, shipping the code, the placement group
  and the host actor);
- steady-state tokens/s: the median of `throughput/tokens_per_second` over the steps after the
  first quarter (compile and warm-up left out).

The nodes start with RAY_worker_niceness=0, so that on a machine shared with other jobs the
trainer competes for the CPU at the same priority as the run without a cluster. Ratios are
cluster / here.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kiln_testing.ray_cluster import ray_cluster
from kiln_testing.steps import write_step

DEVICES = 2  # jax CPU devices of the one host, here and on each cluster node


def run_once(step: Path, prefix: Path, flags: list[str]) -> tuple[float, float]:
    """Trains `step` into `prefix`; returns (seconds to the first step, steady tokens/s)."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={DEVICES}",
    }
    command = [sys.executable, "-m", "kiln.runner", str(step), "--inputs", str(step.parent),
               "--prefix", str(prefix), *flags]  # fmt: skip
    name = json.loads(step.read_text())["name"]
    started = time.monotonic()
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    first_step = None
    while process.poll() is None:
        if first_step is None and _metrics_lines(prefix, name):
            first_step = time.monotonic() - started
        time.sleep(0.05)
    output = process.stdout.read().decode(errors="replace") if process.stdout else ""
    if process.returncode != 0:
        raise SystemExit(f"{' '.join(command)} exited {process.returncode}:\n{output[-3000:]}")
    lines = _metrics_lines(prefix, name)
    rates = [r["throughput/tokens_per_second"] for r in lines if "throughput/tokens_per_second" in r]
    steady = rates[len(rates) // 4 :]
    return first_step or float("nan"), statistics.median(steady)


def _metrics_lines(prefix: Path, name: str) -> list[dict]:
    for path in prefix.glob(f"{name}/*/metrics.jsonl"):
        text = path.read_text()
        return [json.loads(line) for line in text.splitlines() if line.strip().endswith("}")]
    return []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kiln-cluster-bench-"))
    runtime = {"mesh": {"data": DEVICES, "fsdp": 1, "tensor": 1}, "checkpointer.every": 10**6}
    step = write_step(work / "step", **runtime)
    spec = json.loads(step.read_text())
    spec["config"]["num_train_steps"] = args.steps
    step.write_text(json.dumps(spec))
    results: dict[str, list[tuple[float, float]]] = {"here": [], "cluster": []}
    os.environ["RAY_worker_niceness"] = "0"  # read by `ray start` (see the docstring)
    with ray_cluster({}, devices=DEVICES) as address:
        for i in range(args.repeat):
            results["here"].append(run_once(step, work / f"here-{i}", []))
            results["cluster"].append(run_once(step, work / f"cluster-{i}", ["--cluster", address]))
    print(f"# {time.strftime('%Y-%m-%d')}, {platform.machine()}, {os.cpu_count()} cores, "
          f"load {os.getloadavg()[0]:.1f}; {args.steps} steps, median of {args.repeat}")  # fmt: skip
    print("| run | submission to first step (s) | steady tokens/s |")
    print("|---|---|---|")
    medians = {
        where: tuple(statistics.median(r[k] for r in runs) for k in (0, 1))
        for where, runs in results.items()
    }
    for where, (first, rate) in medians.items():
        print(f"| {where} | {first:.1f} | {rate:,.0f} |")
    (here_first, here_rate), (cluster_first, cluster_rate) = medians["here"], medians["cluster"]
    print(f"| cluster / here | {cluster_first / here_first:.2f} | {cluster_rate / here_rate:.2f} |")


if __name__ == "__main__":
    main()
