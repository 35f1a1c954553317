"""Kiln against Levanter's own trainer on one cache: train loss by window, held-out loss, speed.

    ./pants package benchmarks:levanter-train      # Levanter's side, a PEX (levanter-tests)
    ./pants export --resolve=runtime               # Kiln's side, the runtime's virtualenv
    PYTHONPATH=src/python:src/contract dist/export/python/virtualenvs/runtime/*/bin/python \\
        benchmarks/vs_levanter.py --levanter dist/benchmarks/levanter-train.pex --work DIR \\
        [--corpus quickstart pydoc_topics] [--seeds 0 1] [--steps 300] [--attribution]

Corpora, each tokenized once by Levanter's cache builder with the quickstart's tokenizer
(kiln-stdlib-8k) and imported by Kiln (a `levanter_cache` source), so both read the same ids:

    quickstart      the quickstart's training split (stdlib docstrings and pydoc topics):
                    300 steps of 16 x 128 read ~1.3 epochs
    pydoc_topics    the pydoc topics alone: 300 steps read ~6 epochs

Each corpus's validation split (never trained on) is its held-out cache. Per corpus and seed,
one after the other (a seed's runs side by side in time, so speed ratios are of neighbours):

    levanter                    `levanter.main.train_lm` (benchmarks/levanter_train_lm.py),
                                `trainer.seed` = SEED (its initial weights and data order)
    kiln, levanter settings     `python -m kiln.train`, seed = SEED, initialization="levanter",
                                loss_positions="all", data_order="levanter": Levanter's initial
                                weights and windows
    kiln, defaults              Kiln's own initialisation, loss positions and order

and with --attribution the levanter settings with one of Kiln's defaults each (`kiln init`,
`kiln positions`, `kiln order`): what each default costs or gains. Model and optimizer:
experiments:quickstart's with rope theta 5e5; batch 16 x 128, z-loss 1e-4, float32.

Every run's final weights become a transformers folder (Levanter's own HF export, Kiln's
`python -m kiln.interop export`) and one `python -m kiln.interop eval` scores them all on the
held-out cache: the same windows and the same positions (Kiln's validation positions) for every
run. Per run: mean train loss over windows of `--window` steps, held-out loss, tokens/s over
steps 2..N and per CPU-second of the trainer process (ratios against the same seed's Levanter
run), the first step's seconds, peak RSS. A finished run is kept and not rerun; `--report`
only prints WORK's table. Numbers go to `WORK/results.json`, curves to `WORK/curves.png`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
TOKENIZER_DIR = REPO_ROOT / "experiments/tokenizers/kiln-stdlib-8k"
CORPORA = {"quickstart": "all", "pydoc_topics": "pydoc_topics"}  # kiln.data.stdlib_corpus parts
BATCH, SEQ_LEN = 16, 128
CPU_SAMPLE_SECONDS = 0.5
MODEL = {"max_seq_len": 256, "hidden_dim": 128, "intermediate_dim": 512, "num_heads": 4,
         "num_kv_heads": 2, "num_layers": 2, "rope_theta": 500000.0, "norm_eps": 1e-5,
         "tie_embeddings": False, "init_std": 0.02}  # fmt: skip
OPTIMIZER = {"learning_rate": 3e-3, "weight_decay": 0.033, "beta1": 0.9, "beta2": 0.95,
             "epsilon": 1e-8, "max_grad_norm": 1.0, "warmup": 50, "decay": None,
             "min_lr_ratio": 0.1, "lr_schedule": "cosine"}  # fmt: skip
LEVANTER_SETTINGS = {"initialization": "levanter", "loss_positions": "all", "data_order": "levanter"}
KILN_RUNS = {
    "kiln, levanter settings": LEVANTER_SETTINGS,
    "kiln, defaults": {},
}
ATTRIBUTION_RUNS = {  # Levanter's settings with one of Kiln's defaults
    f"kiln, levanter settings but kiln {short}": {
        k: v for k, v in LEVANTER_SETTINGS.items() if k != field
    }
    for short, field in (("init", "initialization"), ("positions", "loss_positions"),
                         ("order", "data_order"))
}  # fmt: skip
LEVANTER = "levanter"
SPLITS = ("train", "validation")
RUNTIME_PATH = os.pathsep.join(p for p in sys.path if p)  # this runtime, for Kiln's commands


@dataclass(frozen=True)
class Run:
    corpus: str
    seed: int
    label: str

    @property
    def folder(self) -> str:
        return f"{self.corpus}/seed-{self.seed}/{self.label.replace(', ', '-').replace(' ', '-')}"

    @property
    def kiln_options(self) -> dict[str, str]:
        return {**KILN_RUNS, **ATTRIBUTION_RUNS}[self.label]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levanter", type=Path, help="levanter-train.pex (not for --report)")
    parser.add_argument("--work", type=Path, help="default: a temporary folder")
    parser.add_argument("--corpus", nargs="+", choices=sorted(CORPORA), default=list(CORPORA))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--window", type=int, default=100, help="steps per train-loss window")
    parser.add_argument("--attribution", action="store_true", help="one Kiln default at a time")
    parser.add_argument("--report", action="store_true", help="only print WORK's finished runs")
    args = parser.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="kiln-vs-levanter-"))
    work.mkdir(parents=True, exist_ok=True)
    labels = [LEVANTER, *KILN_RUNS, *(ATTRIBUTION_RUNS if args.attribution else ())]
    runs = [Run(c, s, label) for c in args.corpus for s in args.seeds for label in labels]
    if not args.report:
        if args.levanter is None:
            parser.error("--levanter is required: ./pants package benchmarks:levanter-train")
        for corpus in args.corpus:
            train_and_score(corpus, [r for r in runs if r.corpus == corpus], args, work)
    rows = [run_row(run, work, args.window) for run in runs if (work / run.folder).exists()]
    (work / "results.json").write_text(json.dumps(rows, indent=1))
    for corpus in args.corpus:
        print_table(corpus, [r for r in rows if r["corpus"] == corpus], args.window)
        print_parity(corpus, [r for r in rows if r["corpus"] == corpus])
    plot_curves(rows, work / "curves.png")
    print(f"\ncurves: {work / 'curves.png'}; numbers: {work / 'results.json'}")


def train_and_score(corpus: str, runs: list[Run], args: argparse.Namespace, work: Path) -> None:
    place = work / corpus
    levanter = LevanterSide(args.levanter)
    texts = {split: write_corpus(corpus, split, place) for split in SPLITS}
    caches = {split: place / split for split in SPLITS}  # Levanter's, each with one component
    imported = {
        split: import_cache(levanter.build_cache(texts[split], caches[split]),
                            place / f"kiln-{split}-cache", corpus, split)  # fmt: skip
        for split in SPLITS
    }
    for run in runs:
        out = work / run.folder
        if (out / "hf").exists():
            continue
        if run.label == LEVANTER:
            levanter.train(out, args.steps, run.seed, texts["train"], caches["train"])
        else:
            kiln_train(out, imported["train"], args.steps, run.seed, run.kiln_options)
    score_held_out([work / run.folder for run in runs], imported["validation"], place)


def write_corpus(corpus: str, split: str, place: Path) -> Path:
    """The corpus's documents of `split` as JSONL lines."""
    from kiln.data.stdlib_corpus import documents, units

    path = place / f"{split}.jsonl"
    if not path.exists():
        place.mkdir(parents=True, exist_ok=True)
        lines = [json.dumps({"text": doc.text}) + "\n"
                 for unit in units(CORPORA[corpus]) for doc in documents(unit.key, split)]  # fmt: skip
        path.write_text("".join(lines))
    return path


class LevanterSide:
    def __init__(self, pex: Path) -> None:
        self.pex = pex

    def _command(self, command: str, corpus: Path, cache: Path, *args: str) -> list[str]:
        return [sys.executable, str(self.pex), command, "--corpus", str(corpus),
                "--tokenizer", str(TOKENIZER_DIR), "--cache", str(cache), *args]  # fmt: skip

    def build_cache(self, corpus: Path, cache: Path) -> Path:
        """Levanter's cache of `corpus`: the folder `train_lm` reads for its one component."""
        split_dir = cache / "stdlib" / "train"
        if not (split_dir / "shard_ledger.json").exists():
            run_measured(self._command("build-cache", corpus, cache), cache.parent / f"{cache.name}.log")
        return split_dir

    def train(self, out: Path, steps: int, seed: int, corpus: Path, cache: Path) -> None:
        """train_lm's run into `out`, its final weights exported to `out/hf` by its own hook."""
        command = self._command("train", corpus, cache, "--out", str(out), "--steps", str(steps),
                                "--seed", str(seed), "--hf-out", str(out / "hf-steps"))  # fmt: skip
        run_measured(command, out.parent / f"{out.name}.log")
        exported = sorted((out / "hf-steps").glob("*/step-*"))  # hf-steps/RUN_ID/step-N
        if not exported:
            raise SystemExit(f"Levanter wrote no HF export under {out / 'hf-steps'}")
        exported[-1].rename(out / "hf")


def import_cache(levanter_split: Path, folder: Path, corpus: str, split: str) -> Path:
    """A Levanter cache as a Kiln cache in `folder` that reads its arrays in place."""
    from kiln.data.tokenize import build_cache

    spec = {
        "spec_version": 1, "kind": "tokenized_cache", "name": f"tokenized/vs_levanter/{corpus}_{split}",
        "version": "2026.12.04", "fingerprint": f"vs-levanter-{corpus}-{split}",
        "config": {"source": {"kind": "levanter_cache", "location": str(levanter_split)},
                   "tokenizer": {"kind": "local", "path": str(TOKENIZER_DIR)},
                   "text_key": "text", "num_shards": 1},
    }  # fmt: skip
    return build_cache(spec, folder)


def kiln_train(out: Path, cache: Path, steps: int, seed: int, options: dict[str, str]) -> None:
    """`python -m kiln.train` into `out/run`, its last checkpoint exported to `out/hf`."""
    run_dir = out / "run"
    run_dir.mkdir(parents=True, exist_ok=True)
    spec_path = run_dir / "train_spec.json"  # where the runner keeps it; export reads it
    spec_path.write_text(json.dumps(kiln_spec(run_dir, cache, steps, seed, options)))
    command = [sys.executable, "-m", "kiln.train", str(spec_path), "--quiet"]
    run_measured(command, out.parent / f"{out.name}.log", PYTHONPATH=RUNTIME_PATH)
    run_interop("export", str(run_dir), str(out / "hf"), "--tokenizer", str(TOKENIZER_DIR))


def run_interop(*args: str) -> None:
    """`python -m kiln.interop ARGS` in this runtime, its table not shown."""
    command = [sys.executable, "-m", "kiln.interop", *args]
    subprocess.run(command, check=True, env={**os.environ, "PYTHONPATH": RUNTIME_PATH},
                   stdout=subprocess.DEVNULL)  # fmt: skip


def kiln_spec(
    run_dir: Path, cache: Path, steps: int, seed: int, options: dict[str, str]
) -> dict[str, Any]:
    """experiments:quickstart's train spec on the imported cache, without validation or evals."""
    model = dict(MODEL)
    if "initialization" in options:
        model["initialization"] = options["initialization"]
    dataset = {"name": "tokenized/vs_levanter/train", "version": "2026.12.04",
               "fingerprint": "vs-levanter", "path": str(cache), "weight": 1.0}  # fmt: skip
    config = {"model": model, "optimizer": OPTIMIZER, "datasets": [dataset], "validation": [],
              "batch_size": BATCH, "seq_len": SEQ_LEN, "num_train_steps": steps,
              "z_loss_weight": 1e-4, "evals": None, "seed": seed, "compute_dtype": "float32",
              "param_dtype": "float32"}  # fmt: skip
    config.update({k: v for k, v in options.items() if k in ("loss_positions", "data_order")})
    return {
        "spec_version": 1, "kind": "lm_checkpoint", "name": "checkpoints/vs_levanter",
        "version": "vs-levanter-dev", "fingerprint": "vs-levanter", "output_path": str(run_dir),
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


def score_held_out(outs: list[Path], held_out: Path, place: Path) -> None:
    """One `kiln.interop eval` of every run's HF folder on the held-out cache, into
    `place/held_out.json` (the same windows and positions for every run)."""
    results = place / "held_out.json"
    folders = [str(out / "hf") for out in outs]
    if results.exists() and set(json.loads(results.read_text())["models"]) >= set(folders):
        return
    run_interop("eval", *folders, "--validation", f"held_out={held_out}", "--seq-len",
                str(SEQ_LEN), "--tokenizer", str(TOKENIZER_DIR), "--out", str(results))  # fmt: skip


def run_measured(command: list[str], log: Path, **env_extra: str) -> None:
    """Runs `command` under /usr/bin/time (its peak RSS and wall time into LOG.time), its
    output into `log`, sampling the trainer's CPU seconds into LOG.cpu.json."""
    log.parent.mkdir(parents=True, exist_ok=True)
    usage = log.with_suffix(".time")
    # Levanter's PEX gets its own environment, not this process's (PEX_*, PYTHONPATH).
    env = {k: v for k, v in os.environ.items() if not k.startswith("PEX") and k != "PYTHONPATH"}
    env.update({"JAX_PLATFORMS": "cpu", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                **env_extra})  # fmt: skip
    print(f"running {log.parent.name}/{log.stem} ...", flush=True)
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


def run_row(run: Run, work: Path, window: int) -> dict[str, Any]:
    """One run's numbers. Kiln numbers steps from 1, Levanter from 0: only the order of steps
    is used. Peak RSS and wall time come from /usr/bin/time's record of the run."""
    out = work / run.folder
    losses, times, first_step = (levanter_log if run.label == LEVANTER else kiln_log)(out)
    peak_kb, wall = (out.parent / f"{out.name}.time").read_text().split()[-2:]
    steps = sorted(losses)
    first, last = steps[0], steps[-1]
    tokens = (last - first) * BATCH * SEQ_LEN
    cpu = cpu_between(out, times[first], times[last])
    curve = [losses[s] for s in steps]
    scored = work / run.corpus / "held_out.json"
    held_out = json.loads(scored.read_text())["models"] if scored.exists() else {}
    return {"corpus": run.corpus, "seed": run.seed, "label": run.label,
            "tokens_per_second": tokens / (times[last] - times[first]),
            "tokens_per_cpu_second": tokens / cpu if cpu else None,
            "first_step_seconds": first_step, "peak_rss_mb": int(peak_kb) / 1024,
            "wall_seconds": float(wall),
            "windows": [statistics.fmean(curve[i:i + window])
                        for i in range(0, len(curve) - window + 1, window)],
            "held_out_loss": held_out.get(str(out / "hf"), {}).get("eval/held_out/loss"),
            "losses": curve}  # fmt: skip


def levanter_log(out: Path) -> tuple[dict[int, float], dict[int, float], float]:
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    times: dict[int, float] = {}
    losses: dict[int, float] = {}
    for r in lines:  # the last step is logged twice, the second time after the final save
        if r.get("event") == "log" and "train/loss" in r["metrics"]:
            times.setdefault(r["step"], r["time"])
            losses.setdefault(r["step"], r["metrics"]["train/loss"])
    first_step = next(r["metrics"]["throughput/duration"] for r in lines
                      if r.get("event") == "log" and "throughput/duration" in r["metrics"])  # fmt: skip
    return losses, times, first_step


def kiln_log(out: Path) -> tuple[dict[int, float], dict[int, float], float]:
    run_dir = out / "run"
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in lines if "train/loss" in r]
    summary = json.loads((run_dir / "summary.json").read_text())
    return ({r["step"]: r["train/loss"] for r in logged},
            {r["step"]: r["timestamp"] for r in logged}, summary["first_step_seconds"])  # fmt: skip


def print_table(corpus: str, rows: list[dict[str, Any]], window: int) -> None:
    """Per configuration, the mean over seeds and each seed's value (in seed order). Speed
    ratios are of each seed's run against the same seed's Levanter run, run beside it: per wall
    second and, steadier on a shared machine, per CPU-second of the trainer process."""
    levanter = {r["seed"]: r for r in rows if r["label"] == LEVANTER}
    labels = list(dict.fromkeys(r["label"] for r in rows))
    windows = len(rows[0]["windows"]) if rows else 0
    spans = [f"train {i * window + 1}-{(i + 1) * window}" for i in range(windows)]
    print(f"\n{corpus}: mean over seeds (each seed)")
    print(f"| run | {' | '.join(spans)} | held-out | tokens/s vs Levanter | "
          "tokens/CPU-s vs Levanter | first step s | peak RSS MB |")
    print("| --- " * (windows + 6) + "|")
    for label in labels:
        mine = sorted((r for r in rows if r["label"] == label), key=lambda r: r["seed"])
        cells = [spread([r["windows"][i] for r in mine]) for i in range(windows)]
        scored = [r["held_out_loss"] for r in mine if r["held_out_loss"] is not None]
        cells.append(spread(scored) if scored else "n/a")
        for key in ("tokens_per_second", "tokens_per_cpu_second"):
            ratios = [r[key] / levanter[r["seed"]][key] for r in mine
                      if r[key] and r["seed"] in levanter and levanter[r["seed"]][key]]  # fmt: skip
            cells.append(spread(ratios, digits=2) if ratios else "n/a")
        cells.append(f"{statistics.fmean(r['first_step_seconds'] for r in mine):.1f}")
        cells.append(f"{statistics.fmean(r['peak_rss_mb'] for r in mine):,.0f}")
        print(f"| {label} | {' | '.join(cells)} |")


def print_parity(corpus: str, rows: list[dict[str, Any]]) -> None:
    """How far Kiln with Levanter's settings is from Levanter, step by step, for each seed."""
    by_key = {(r["label"], r["seed"]): r for r in rows}
    for seed in sorted({r["seed"] for r in rows}):
        ours, theirs = by_key.get(("kiln, levanter settings", seed)), by_key.get((LEVANTER, seed))
        if ours and theirs and len(ours["losses"]) == len(theirs["losses"]):
            gaps = [abs(a - b) for a, b in zip(ours["losses"], theirs["losses"], strict=True)]
            print(f"{corpus}, seed {seed}: Kiln with Levanter's settings vs Levanter, train loss "
                  f"at every step: largest difference {max(gaps):.2e}, mean {statistics.fmean(gaps):.2e}")  # fmt: skip


def spread(values: list[float], digits: int = 3) -> str:
    each = " / ".join(f"{v:.{digits}f}" for v in values)
    return f"{statistics.fmean(values):.{digits}f} ({each})"


def plot_curves(rows: list[dict[str, Any]], path: Path) -> None:
    """Each corpus's curves (every seed), smoothed over 10 steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    corpora = list(dict.fromkeys(r["corpus"] for r in rows))
    if not corpora:
        return
    figure, axes = plt.subplots(1, len(corpora), figsize=(7 * len(corpora), 5), squeeze=False)
    colours = {}
    for axis, corpus in zip(axes[0], corpora, strict=True):
        for r in (r for r in rows if r["corpus"] == corpus):
            colour = colours.setdefault(r["label"], f"C{len(colours)}")
            smooth = [statistics.fmean(r["losses"][max(0, i - 9):i + 1]) for i in range(len(r["losses"]))]
            label = r["label"] if r["seed"] == min(x["seed"] for x in rows) else None
            axis.plot(range(1, len(smooth) + 1), smooth, color=colour, lw=1, label=label)
        axis.set_xlabel("step")
        axis.set_ylabel("train loss, 10-step mean (nats/token, z-loss included)")
        axis.set_ylim(top=8)
        axis.set_title(f"{corpus}: Kiln and Levanter, every seed")
        axis.legend(fontsize=8)
    figure.savefig(path, dpi=110, bbox_inches="tight")


if __name__ == "__main__":
    main()
