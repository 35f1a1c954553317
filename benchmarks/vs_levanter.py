"""Kiln against Levanter's own trainer on one cache: train loss by window, held-out loss, speed.

    ./pants package benchmarks:levanter-train      # Levanter's side, a PEX (levanter-tests)
    ./pants export --resolve=runtime               # Kiln's side, the runtime's virtualenv
    PYTHONPATH=src/python:src/contract dist/export/python/virtualenvs/runtime/*/bin/python \\
        benchmarks/vs_levanter.py --levanter dist/benchmarks/levanter-train.pex --work DIR \\
        [--corpus quickstart quickstart_every_5th] [--seeds 0 1 2] [--steps 300] [--attribution]

Training corpora, each tokenized once by Levanter's cache builder with the quickstart's
tokenizer (kiln-stdlib-8k) and imported by Kiln (a `levanter_cache` source), so both read the
same ids:

    quickstart            the quickstart's training split (stdlib docstrings and pydoc topics):
                          300 steps of 16 x 128 read ~1.3 epochs
    quickstart_every_5th  every fifth document of that split: a sample of the same text that
                          300 steps read ~8 times (75,081 tokens), so runs overfit

Held out for both: the quickstart's validation split (112 documents, never trained on).

Runs go in groups, one per corpus and seed: Levanter's run with every Kiln run beside it in
time (the first Kiln run before it, the others after), every other group in reverse order, so
that slow drift on a shared machine cancels in the speed ratios over groups:

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
run. Train losses are each trainer's own: a run without loss_positions="all" averages over other
positions than Levanter's, so only held-out losses compare across that setting.

Per configuration the tables give mean [min, max] over seeds of: train loss over windows of
`--window` steps, held-out loss and its difference from the same seed's Levanter run (marked
"within noise" when its mean is smaller than its min-max spread), speed against the group's
Levanter run per CPU-second of the trainer process (the headline: it holds on a shared machine)
and per wall second (tokens over steps 2..N), the first step's seconds, peak RSS. A finished
run is kept and not rerun; `--report` only prints WORK's tables. Numbers go to
`WORK/results.json`, curves to `WORK/curves.png`.
"""

from __future__ import annotations

import argparse
import json
import operator
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
TOKENIZER_DIR = REPO_ROOT / "experiments/tokenizers/kiln-stdlib-8k"
CORPORA = {"quickstart": 1, "quickstart_every_5th": 5}  # every Nth training document
MIN_HELD_OUT_DOCUMENTS = 100
BATCH, SEQ_LEN = 16, 128
CPU_SAMPLE_SECONDS = 0.5
MODEL = {"max_seq_len": 256, "hidden_dim": 128, "intermediate_dim": 512, "num_heads": 4,
         "num_kv_heads": 2, "num_layers": 2, "rope_theta": 500000.0, "norm_eps": 1e-5,
         "tie_embeddings": False, "init_std": 0.02}  # fmt: skip
OPTIMIZER = {"learning_rate": 3e-3, "weight_decay": 0.033, "beta1": 0.9, "beta2": 0.95,
             "epsilon": 1e-8, "max_grad_norm": 1.0, "warmup": 50, "decay": None,
             "min_lr_ratio": 0.1, "lr_schedule": "cosine"}  # fmt: skip
LEVANTER_SETTINGS = {
    "initialization": "levanter", "loss_positions": "all", "data_order": "levanter"
}  # fmt: skip
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
KILN_OPTIONS = {**KILN_RUNS, **ATTRIBUTION_RUNS}
LEVANTER = "levanter"
HELD_OUT = "held_out"  # WORK's folder for the held-out documents and caches
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
        return KILN_OPTIONS[self.label]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levanter", type=Path, help="levanter-train.pex (not for --report)")
    parser.add_argument("--work", type=Path, help="default: a temporary folder")
    parser.add_argument("--corpus", nargs="+", choices=sorted(CORPORA), default=list(CORPORA))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--window", type=int, default=100, help="steps per train-loss window")
    parser.add_argument("--attribution", action="store_true", help="one Kiln default at a time")
    parser.add_argument("--report", action="store_true", help="only print WORK's finished runs")
    args = parser.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="kiln-vs-levanter-"))
    work.mkdir(parents=True, exist_ok=True)
    kiln_labels = [*KILN_RUNS, *(ATTRIBUTION_RUNS if args.attribution else ())]
    runs = in_time_order(args.corpus, args.seeds, kiln_labels)
    if not args.report:
        if args.levanter is None:
            parser.error("--levanter is required: ./pants package benchmarks:levanter-train")
        train_and_score(runs, args, work)
    rows = [run_row(run, work, args.window) for run in runs if (work / run.folder / "hf").exists()]
    (work / "results.json").write_text(json.dumps(rows, indent=1))
    for corpus in args.corpus:
        print_table(corpus, [r for r in rows if r["corpus"] == corpus], args.window)
        print_parity(corpus, [r for r in rows if r["corpus"] == corpus])
    print_speed(rows)
    plot_curves(rows, work / "curves.png")
    print(f"\ncurves: {work / 'curves.png'}; numbers: {work / 'results.json'}")


def in_time_order(corpora: list[str], seeds: list[int], kiln_labels: list[str]) -> list[Run]:
    """One group per corpus and seed: the first Kiln run, Levanter's, the other Kiln runs, so
    that the main two are each beside their Levanter run; every other group reversed, so that
    each goes first as often as second and drift over time cancels in the mean ratio."""
    group = [kiln_labels[0], LEVANTER, *kiln_labels[1:]]
    keys = [(corpus, seed) for corpus in corpora for seed in seeds]
    return [Run(corpus, seed, label) for i, (corpus, seed) in enumerate(keys)
            for label in (group if i % 2 == 0 else group[::-1])]  # fmt: skip


def train_and_score(runs: list[Run], args: argparse.Namespace, work: Path) -> None:
    levanter = LevanterSide(args.levanter)
    texts, caches, imported = {}, {}, {}
    for name in [HELD_OUT, *dict.fromkeys(run.corpus for run in runs)]:
        place = work / name
        texts[name] = write_corpus(name, place / "documents.jsonl")
        caches[name] = place / "levanter-cache"  # Levanter's, with one component
        split_dir = levanter.build_cache(texts[name], caches[name])
        imported[name] = import_cache(split_dir, place / "kiln-cache", name)
    for run in runs:
        out = work / run.folder
        if (out / "hf").exists():
            continue
        if run.label == LEVANTER:
            levanter.train(out, args.steps, run.seed, texts[run.corpus], caches[run.corpus])
        else:
            kiln_train(out, imported[run.corpus], args.steps, run.seed, run.kiln_options)
    score_held_out([work / run.folder for run in runs], imported[HELD_OUT], work / HELD_OUT)


def write_corpus(name: str, path: Path) -> Path:
    """The documents of `name` (a training corpus or HELD_OUT) as JSONL lines."""
    if not path.exists():
        texts = held_out_texts() if name == HELD_OUT else training_texts(CORPORA[name])
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    return path


def training_texts(every: int) -> list[str]:
    """Every `every`th document of the quickstart's training split: a smaller sample of the
    same text as the held-out set, so a corpus that repeats overfits rather than shifts topic."""
    from kiln.data.stdlib_corpus import documents, units

    texts = [doc.text for unit in units("all") for doc in documents(unit.key, "train")]
    return texts[::every]


def held_out_texts() -> list[str]:
    """The quickstart's validation split, held out for every corpus."""
    from kiln.data.stdlib_corpus import documents, units

    texts = [doc.text for unit in units("all") for doc in documents(unit.key, "validation")]
    if len(texts) < MIN_HELD_OUT_DOCUMENTS:
        raise SystemExit(f"the quickstart's validation split has {len(texts)} documents, "
                         f"fewer than {MIN_HELD_OUT_DOCUMENTS}: run this with Python 3.12, "
                         "the runtime's")  # fmt: skip
    return texts


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
            log = cache.parent / f"{cache.name}.log"
            run_measured(self._command("build-cache", corpus, cache), log)
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


def import_cache(levanter_split: Path, folder: Path, name: str) -> Path:
    """A Levanter cache as a Kiln cache in `folder` that reads its arrays in place."""
    from kiln.data.tokenize import build_cache

    spec = {
        "spec_version": 1, "kind": "tokenized_cache", "name": f"tokenized/vs_levanter/{name}",
        "version": "2026.12.06", "fingerprint": f"vs-levanter-{name}",
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
    scored = work / HELD_OUT / "held_out.json"
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
    first_step = next(r["metrics"]["throughput/duration"] for r in lines if r.get("event") == "log"
                      and "throughput/duration" in r["metrics"])  # fmt: skip
    return losses, times, first_step


def kiln_log(out: Path) -> tuple[dict[int, float], dict[int, float], float]:
    run_dir = out / "run"
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in lines if "train/loss" in r]
    summary = json.loads((run_dir / "summary.json").read_text())
    return ({r["step"]: r["train/loss"] for r in logged},
            {r["step"]: r["timestamp"] for r in logged}, summary["first_step_seconds"])  # fmt: skip


def print_table(corpus: str, rows: list[dict[str, Any]], window: int) -> None:
    """Per configuration, mean [min, max] over seeds. Differences and ratios are each seed's run
    against the same seed's Levanter run (for speed: the one beside it in time)."""
    if not rows:
        return
    labels = sorted(dict.fromkeys(r["label"] for r in rows), key=lambda label: label != LEVANTER)
    windows = len(rows[0]["windows"]) if rows else 0
    spans = [f"train {i * window + 1}-{(i + 1) * window}" for i in range(windows)]
    print(f"\n{corpus}: mean [min, max] over seeds {sorted({r['seed'] for r in rows})}")
    print(
        f"| run | {' | '.join(spans)} | held-out | held-out vs Levanter | "
        "tokens/CPU-s vs Levanter | tokens/s vs Levanter | first step s | peak RSS MB |"
    )
    print("| --- " * (windows + 7) + "|")
    for label in labels:
        mine = [r for r in rows if r["label"] == label]
        cells = [spread([r["windows"][i] for r in mine]) for i in range(windows)]
        cells.append(spread([r["held_out_loss"] for r in mine if r["held_out_loss"] is not None]))
        cells.append(difference(against_levanter(mine, rows, "held_out_loss", operator.sub)))
        for key in ("tokens_per_cpu_second", "tokens_per_second"):
            cells.append(spread(against_levanter(mine, rows, key, operator.truediv), digits=2))
        cells.append(spread([r["first_step_seconds"] for r in mine], digits=1))
        cells.append(spread([r["peak_rss_mb"] for r in mine], digits=0))
        print(f"| {label} | {' | '.join(cells)} |")
    other_positions = [label for label in labels if label != LEVANTER
                       and KILN_OPTIONS[label].get("loss_positions") != "all"]  # fmt: skip
    if other_positions:
        print(
            f"train losses of {', '.join(other_positions)}: over other positions than "
            "Levanter's (loss_positions), so compare those runs by held-out loss"
        )


def against_levanter(
    runs: list[dict[str, Any]], rows: list[dict[str, Any]], key: str,
    compare: Callable[[float, float], float],
) -> list[float]:  # fmt: skip
    """compare(run's `key`, its group's Levanter run's `key`) for each run where both have one."""
    levanter = {(r["corpus"], r["seed"]): r[key] for r in rows if r["label"] == LEVANTER}
    return [compare(r[key], levanter[r["corpus"], r["seed"]]) for r in runs
            if r[key] and levanter.get((r["corpus"], r["seed"]))]  # fmt: skip


def print_parity(corpus: str, rows: list[dict[str, Any]]) -> None:
    """How far Kiln with Levanter's settings is from Levanter, step by step, for each seed."""
    by_key = {(r["label"], r["seed"]): r for r in rows}
    for seed in sorted({r["seed"] for r in rows}):
        ours, theirs = by_key.get(("kiln, levanter settings", seed)), by_key.get((LEVANTER, seed))
        if ours and theirs and len(ours["losses"]) == len(theirs["losses"]):
            gaps = [abs(a - b) for a, b in zip(ours["losses"], theirs["losses"], strict=True)]
            print(f"{corpus}, seed {seed}: Kiln with Levanter's settings vs Levanter, train loss "
                  f"at every step: largest difference {max(gaps):.2e}, "
                  f"mean {statistics.fmean(gaps):.2e}")  # fmt: skip


def print_speed(rows: list[dict[str, Any]]) -> None:
    """Each Kiln configuration's speed against the Levanter run beside it, over every corpus and
    seed: per CPU-second of the trainer (the headline) and per wall second."""
    print("\nspeed against the Levanter run beside it, mean [min, max] over every pair:")
    for label in dict.fromkeys(r["label"] for r in rows if r["label"] != LEVANTER):
        mine = [r for r in rows if r["label"] == label]
        per_cpu = against_levanter(mine, rows, "tokens_per_cpu_second", operator.truediv)
        per_wall = against_levanter(mine, rows, "tokens_per_second", operator.truediv)
        print(
            f"{label}: per CPU-second {spread(per_cpu, digits=2)} ({len(per_cpu)} pairs), "
            f"per wall second {spread(per_wall, digits=2)}"
        )


def spread(values: list[float], digits: int = 3) -> str:
    """mean [min, max]; n/a without values."""
    if not values:
        return "n/a"
    mean, low, high = statistics.fmean(values), min(values), max(values)
    return f"{mean:,.{digits}f} [{low:,.{digits}f}, {high:,.{digits}f}]"


def difference(values: list[float]) -> str:
    """A signed spread, "within noise" when its mean is smaller than its min-max spread (which
    is always so when the seeds disagree in sign)."""
    if not values:
        return "n/a"
    mean, low, high = statistics.fmean(values), min(values), max(values)
    noise = ", within noise" if abs(mean) < high - low else ""
    return f"{mean:+.3f} [{low:+.3f}, {high:+.3f}]{noise}"


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
            losses = r["losses"]
            smooth = [statistics.fmean(losses[max(0, i - 9) : i + 1]) for i in range(len(losses))]
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
