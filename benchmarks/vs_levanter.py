"""Kiln against Levanter's own trainer: one cache, one config, runs interleaved.

    ./pants package benchmarks:levanter-train          # Levanter's side, a PEX (levanter-tests)
    PYTHONPATH=src/python:src/contract python3 benchmarks/vs_levanter.py \\
        --levanter dist/benchmarks/levanter-train.pex [--work DIR --rounds 2 --steps 300]

Run in the runtime's environment (3rdparty/python/runtime.lock). The corpus is the
quickstart's (the stdlib's docstrings and pydoc topics, train split) as JSONL; Levanter's cache
builder tokenizes it with the quickstart's tokenizer (kiln-stdlib-8k), and Kiln imports that very
cache (a `levanter_cache` source), so both read the same token ids. Each round runs, one after
the other:

    levanter                    `levanter.main.train_lm` (benchmarks/levanter_train_lm.py)
    kiln, levanter settings     `python -m kiln.train` with initialization="levanter" and
                                loss_positions="all": Levanter's initial weights (the same seed)
    kiln, defaults              the same with Kiln's own initialisation and loss positions

and, once, Levanter with another data seed (its initial weights unchanged), which measures what
the order of the windows alone does to the curve. The model and optimizer are experiments:
quickstart's with rope theta 5e5, batch 16 x 128, z-loss 1e-4, float32, no validation.

Per run: tokens/s over steps 2..N (from each trainer's own log times of step 1 and step N: the
same definition on both sides), the first step's seconds (compilation included), peak RSS
(/usr/bin/time), the mean train loss over the last 30 steps, and the speed ratio against the
same round's Levanter run. It writes the loss curves to `WORK/curves.png` and the numbers to
`WORK/results.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
TOKENIZER_DIR = REPO_ROOT / "experiments/tokenizers/kiln-stdlib-8k"
BATCH, SEQ_LEN, TAIL = 16, 128, 30
CPU_SAMPLE_SECONDS = 0.5
MODEL = {"max_seq_len": 256, "hidden_dim": 128, "intermediate_dim": 512, "num_heads": 4,
         "num_kv_heads": 2, "num_layers": 2, "rope_theta": 500000.0, "norm_eps": 1e-5,
         "tie_embeddings": False, "init_std": 0.02}  # fmt: skip
OPTIMIZER = {"learning_rate": 3e-3, "weight_decay": 0.033, "beta1": 0.9, "beta2": 0.95,
             "epsilon": 1e-8, "max_grad_norm": 1.0, "warmup": 50, "decay": None,
             "min_lr_ratio": 0.1, "lr_schedule": "cosine"}  # fmt: skip
KILN_RUNS = {
    "kiln, levanter settings": {"initialization": "levanter", "loss_positions": "all"},
    "kiln, defaults": {},
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levanter", type=Path, help="levanter-train.pex (not for --report)")
    parser.add_argument("--work", type=Path, help="default: a temporary folder")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--report", action="store_true", help="only print WORK's finished runs")
    args = parser.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="kiln-vs-levanter-"))
    work.mkdir(parents=True, exist_ok=True)
    runs = planned_runs(work, args.rounds)
    if not args.report:
        if args.levanter is None:
            parser.error("--levanter is required: ./pants package benchmarks:levanter-train")
        run_all(runs, args.levanter, work, args.steps)
    rows = [(levanter_row if label.startswith("levanter") else kiln_row)(out, label, round_index)
            for label, round_index, out in runs]  # fmt: skip
    (work / "results.json").write_text(json.dumps(rows, indent=1))
    print_table(rows)
    plot_curves(rows, work / "curves.png")
    print(f"\ncurves: {work / 'curves.png'}; numbers: {work / 'results.json'}")


def run_all(runs: list[tuple[str, int, Path]], pex: Path, work: Path, steps: int) -> None:
    corpus = write_corpus(work / "stdlib_train.jsonl")
    levanter = LevanterSide(pex, corpus, work / "levanter-cache")
    levanter.build_cache()
    kiln_cache = import_cache(levanter.split_dir, work / "kiln-cache")
    for label, _, out in runs:
        if label.startswith("levanter"):
            levanter.train(out, steps, data_seed=1 if "data seed" in label else None)
        else:
            kiln_train(out, kiln_cache, steps, KILN_RUNS[label])


def planned_runs(work: Path, rounds: int) -> list[tuple[str, int, Path]]:
    """(label, round, output folder) of every run, in the order they run: the trainers
    interleaved round by round, then Levanter with another data seed."""
    runs = []
    for round_index in range(rounds):
        for label in ("levanter", *KILN_RUNS):
            folder = label.replace(", ", "-").replace(" ", "-")
            runs.append((label, round_index, work / f"round-{round_index}" / folder))
    runs.append(("levanter, data seed 1", 0, work / "levanter-data-seed-1"))
    return runs


def write_corpus(path: Path) -> Path:
    """The quickstart's training documents (experiments:stdlib_train) as JSONL lines."""
    from kiln.data.stdlib_corpus import documents, units

    if not path.exists():
        lines = [json.dumps({"text": doc.text}) + "\n"
                 for unit in units("all") for doc in documents(unit.key, "train")]  # fmt: skip
        path.write_text("".join(lines))
    return path


class LevanterSide:
    def __init__(self, pex: Path, corpus: Path, cache: Path) -> None:
        self.pex, self.corpus, self.cache = pex, corpus, cache
        self.split_dir = cache / "stdlib" / "train"

    def _command(self, *args: str) -> list[str]:
        return [sys.executable, str(self.pex), *args, "--corpus", str(self.corpus),
                "--tokenizer", str(TOKENIZER_DIR), "--cache", str(self.cache)]  # fmt: skip

    def build_cache(self) -> None:
        if not (self.split_dir / "shard_ledger.json").exists():
            run_measured(self._command("build-cache"), self.cache.parent / "levanter-cache.log")

    def train(self, out: Path, steps: int, data_seed: int | None = None) -> None:
        extra = [] if data_seed is None else ["--data-seed", str(data_seed)]
        command = self._command("train", "--out", str(out), "--steps", str(steps), *extra)
        run_measured(command, out.parent / f"{out.name}.log")


def levanter_row(out: Path, label: str, round_index: int) -> dict[str, Any]:
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in lines if r.get("event") == "log" and "train/loss" in r["metrics"]]
    times: dict[int, float] = {}
    losses: dict[int, float] = {}
    for r in logged:  # the last step is logged twice, the second time after the final save
        times.setdefault(r["step"], r["time"])
        losses.setdefault(r["step"], r["metrics"]["train/loss"])
    first_step = next(r["metrics"]["throughput/duration"] for r in lines
                      if r.get("event") == "log" and "throughput/duration" in r["metrics"])
    return row(label, round_index, losses, times, first_step, out)


def import_cache(levanter_split: Path, folder: Path) -> Path:
    """The Levanter cache as a Kiln cache that reads its arrays in place."""
    from kiln.data.tokenize import build_cache

    spec = {
        "spec_version": 1, "kind": "tokenized_cache", "name": "tokenized/vs_levanter/stdlib",
        "version": "2026.12.01", "fingerprint": "vs-levanter",
        "config": {"source": {"kind": "levanter_cache", "location": str(levanter_split)},
                   "tokenizer": {"kind": "local", "path": str(TOKENIZER_DIR)},
                   "text_key": "text", "num_shards": 1},
    }  # fmt: skip
    return build_cache(spec, folder)


def kiln_train(out: Path, cache: Path, steps: int, options: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    spec_path = out.parent / f"{out.name}.json"
    spec_path.write_text(json.dumps(kiln_spec(out, cache, steps, options)))
    command = [sys.executable, "-m", "kiln.train", str(spec_path), "--quiet"]
    python_path = os.pathsep.join(p for p in sys.path if p)  # this runtime, for kiln.train
    run_measured(command, out.parent / f"{out.name}.log", PYTHONPATH=python_path)


def kiln_row(out: Path, label: str, round_index: int) -> dict[str, Any]:
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in lines if "train/loss" in r]
    times = {r["step"]: r["timestamp"] for r in logged}
    losses = {r["step"]: r["train/loss"] for r in logged}
    summary = json.loads((out / "summary.json").read_text())
    return row(label, round_index, losses, times, summary["first_step_seconds"], out)


def kiln_spec(out: Path, cache: Path, steps: int, options: dict[str, Any]) -> dict[str, Any]:
    """experiments:quickstart's train spec on the imported cache, without validation or evals."""
    model = dict(MODEL)
    if "initialization" in options:
        model["initialization"] = options["initialization"]
    dataset = {"name": "tokenized/vs_levanter/stdlib", "version": "2026.12.01",
               "fingerprint": "vs-levanter", "path": str(cache), "weight": 1.0}  # fmt: skip
    config = {"model": model, "optimizer": OPTIMIZER, "datasets": [dataset], "validation": [],
              "batch_size": BATCH, "seq_len": SEQ_LEN, "num_train_steps": steps,
              "z_loss_weight": 1e-4, "evals": None, "seed": 0, "compute_dtype": "float32",
              "param_dtype": "float32"}  # fmt: skip
    if "loss_positions" in options:
        config["loss_positions"] = options["loss_positions"]
    return {
        "spec_version": 1, "kind": "lm_checkpoint", "name": "checkpoints/vs_levanter",
        "version": "vs-levanter-dev", "fingerprint": "vs-levanter", "output_path": str(out),
        "config": config,
        "runtime": {
            "resources": {"kind": "cpu"}, "mesh": {"data": -1, "fsdp": 1, "tensor": 1},
            "attention": "auto", "gradient_checkpointing": "none", "per_device_parallelism": None,
            "validation_every": 10 * steps, "max_eval_batches": None,
            "checkpointer": {"save_interval_minutes": 60, "keep_last_temporary": 1,
                             "every": None, "temporary_base_path": None},
            "wandb": {"mode": "disabled", "project": "kiln", "entity": None, "run_id": None,
                      "group": None, "tags": []},
            "control": {"enabled": False, "host": "127.0.0.1", "port": 0,
                        "token_ttl_minutes": 720},
            "progress": "log", "max_steps_this_run": None, "validate_at_start": False,
            "validation_names": {},
        },
    }  # fmt: skip


def run_measured(command: list[str], log: Path, **env_extra: str) -> None:
    """Runs `command` under /usr/bin/time (its peak RSS and wall time into LOG.time), its
    output into `log`."""
    log.parent.mkdir(parents=True, exist_ok=True)
    usage = log.with_suffix(".time")
    # Levanter's PEX gets its own environment, not this process's (PEX_*, PYTHONPATH).
    env = {k: v for k, v in os.environ.items() if not k.startswith("PEX") and k != "PYTHONPATH"}
    env.update({"JAX_PLATFORMS": "cpu", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                **env_extra})  # fmt: skip
    print(f"running {log.stem} ...", flush=True)
    samples = []
    with log.open("w") as output:
        process = subprocess.Popen(["/usr/bin/time", "-f", "%M %e", "-o", str(usage), *command],
                                   stdout=output, stderr=subprocess.STDOUT, env=env)  # fmt: skip
        while process.poll() is None:
            samples.append((time.time(), child_cpu_seconds(process.pid)))
            time.sleep(CPU_SAMPLE_SECONDS)
    log.with_suffix(".cpu.json").write_text(json.dumps(samples))
    if process.returncode:
        raise SystemExit(f"{' '.join(command[:4])} exited {process.returncode}; see {log}")


def child_cpu_seconds(time_pid: int) -> float | None:
    """User + system CPU seconds of the process /usr/bin/time runs (all its threads)."""
    try:
        children = Path(f"/proc/{time_pid}/task/{time_pid}/children").read_text().split()
        fields = Path(f"/proc/{children[0]}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_between(out: Path, start: float, end: float) -> float | None:
    """The trainer's CPU seconds between two of its log times, from the samples taken while it
    ran (None when they do not cover that stretch)."""
    path = out.parent / f"{out.name}.cpu.json"
    if not path.exists():
        return None
    samples = [(t, cpu) for t, cpu in json.loads(path.read_text()) if cpu is not None]

    def at(moment: float) -> float | None:
        before = [cpu for t, cpu in samples if t <= moment]
        after = [cpu for t, cpu in samples if t >= moment]
        return (before[-1] + after[0]) / 2 if before and after else None

    first, last = at(start), at(end)
    return None if first is None or last is None else last - first


def row(
    label: str, round_index: int, losses: dict[int, float], times: dict[int, float],
    first_step: float, out: Path,
) -> dict[str, Any]:  # fmt: skip
    """One run's numbers (Kiln numbers steps from 1, Levanter from 0: only differences of
    steps are used). Peak RSS and wall time come from /usr/bin/time's record of the run."""
    peak_kb, wall = (out.parent / f"{out.name}.time").read_text().split()[-2:]
    peak_rss = int(peak_kb) / 1024
    steps = sorted(losses)
    first, last = steps[0], steps[-1]
    tokens = (last - first) * BATCH * SEQ_LEN
    tokens_per_second = tokens / (times[last] - times[first])
    cpu = cpu_between(out, times[first], times[last])
    tail = [losses[s] for s in steps[-TAIL:]]
    return {"label": label, "round": round_index, "tokens_per_second": tokens_per_second,
            "tokens_per_cpu_second": tokens / cpu if cpu else None,
            "first_step_seconds": first_step, "peak_rss_mb": peak_rss, "wall_seconds": float(wall),
            "loss_first": losses[first], "loss_tail_mean": sum(tail) / len(tail),
            "losses": [losses[s] for s in steps]}  # fmt: skip


def print_table(rows: list[dict[str, Any]]) -> None:
    """Speed ratios are against the same round's Levanter run: per wall second and, steadier on
    a shared machine, per CPU-second of the trainer process over the same steps."""
    levanter = {r["round"]: r for r in rows if r["label"] == "levanter"}
    print(f"\n| run | round | tokens/s | vs Levanter | tokens/CPU-s | vs Levanter | first step s "
          f"| peak RSS MB | step-1 loss | mean loss, last {TAIL} steps |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        base = levanter[r["round"]]
        per_cpu, base_cpu = r["tokens_per_cpu_second"], base["tokens_per_cpu_second"]
        cpu = "n/a | n/a" if not (per_cpu and base_cpu) else f"{per_cpu:,.0f} | {per_cpu / base_cpu:.2f}"
        print(f"| {r['label']} | {r['round']} | {r['tokens_per_second']:,.0f} | "
              f"{r['tokens_per_second'] / base['tokens_per_second']:.2f} | {cpu} | "
              f"{r['first_step_seconds']:.1f} | {r['peak_rss_mb']:,.0f} | {r['loss_first']:.2f} | "
              f"{r['loss_tail_mean']:.3f} |")  # fmt: skip


def plot_curves(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(8, 5))
    for r in rows:
        if r["round"] == 0:
            axis.plot(range(1, len(r["losses"]) + 1), r["losses"], label=r["label"], lw=1)
    axis.set_xlabel("step")
    axis.set_ylabel("train loss (nats/token, z-loss included)")
    axis.set_ylim(top=10)
    axis.legend()
    axis.set_title("Kiln and Levanter, one cache, one config (round 0)")
    figure.savefig(path, dpi=110, bbox_inches="tight")


if __name__ == "__main__":
    main()
