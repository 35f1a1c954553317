"""Start-up of the quickstart's training: process start to first step done, cold vs warm cache.

    PYTHONPATH=src/python:src/contract python3 benchmarks/warm_start.py [--work DIR]

Run in the runtime's environment (jax, orbax, lm-eval: 3rdparty/python/runtime.lock). It builds
the quickstart's two token caches (the stdlib corpus, kiln-stdlib-8k; kept in --work for the
next time), then starts `python -m kiln.train SPEC.json` with the quickstart's config
(experiments:quickstart: 2 layers, d=128, batch 16 x 128, float32, validation and the lm-eval
task) four times, each for one step (runtime.max_steps_this_run = 1), with jax's persistent
compilation cache in a store folder as `pants run` sets it (kiln.train.compilation_cache):

    cold start     an empty cache, a new run
    warm start     the cache the cold start filled, a new run
    warm restart   the same cache, resuming the warm start's run from its step-1 checkpoint
    cold restart   an empty cache, resuming the cold start's run (what every restart cost
                   before the cache)

"to first step" runs from starting the process to the trainer's "first step in" line (imports,
opening the caches, the lm-eval task, initialising or restoring the state, the first step);
"first step" is the trainer's own time for that step (its compilation or cache read included).
Pants' own start (`pants run`, benchmarks/noop_run.py) comes on top. Goal: warm restart <= 5 s.
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
TOKENIZER = {"kind": "local", "path": str(REPO_ROOT / "experiments/tokenizers/kiln-stdlib-8k")}
EVAL_TASKS = REPO_ROOT / "experiments/eval_tasks"
GOAL_SECONDS = 5.0
FIRST_STEP_LINE = "first step in "  # the trainer's message once its first step is done


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, help="keep caches and runs here (default: a temp dir)")
    args = parser.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="kiln-warm-start-"))
    splits = ("train", "validation")
    caches = {split: build_quickstart_cache(work / "caches", split) for split in splits}
    runs, stores = work / f"runs-{os.getpid()}", work / f"stores-{os.getpid()}"
    rows = [
        measure("cold start", runs / "a", caches, stores / "cold"),
        measure("warm start", runs / "b", caches, stores / "cold"),
        measure("warm restart", runs / "b", caches, stores / "cold"),
        measure("cold restart", runs / "a", caches, stores / "empty"),
    ]
    print_table(rows)


def build_quickstart_cache(folder: Path, split: str) -> Path:
    """experiments:stdlib_train / stdlib_validation, built here (served when built already)."""
    from kiln.data.tokenize import build_cache

    spec = {
        "spec_version": 1,
        "kind": "tokenized_cache",
        "name": f"tokenized/quickstart/stdlib_{split}",
        "version": "2026.11.29",
        "fingerprint": f"warm-start-{split}",
        "config": {
            "source": {"kind": "python_stdlib", "part": "all", "split": split},
            "tokenizer": TOKENIZER,
            "text_key": "text",
            "max_document_chars": 100_000,
            "num_shards": 2 if split == "train" else 1,
        },
    }
    started = time.monotonic()
    path = build_cache(spec, folder / split)
    print(f"cache {split}: {path} ({time.monotonic() - started:.1f}s)", flush=True)
    return path


def quickstart_spec(output: Path, caches: dict[str, Path]) -> dict[str, Any]:
    """experiments:quickstart's train spec (the values of experiments/BUILD), one step a run."""

    def dataset(split: str, weight: float | None = None) -> dict[str, Any]:
        entry = {"name": f"tokenized/quickstart/stdlib_{split}", "version": "2026.11.29",
                 "fingerprint": f"warm-start-{split}", "path": str(caches[split])}  # fmt: skip
        return entry if weight is None else {**entry, "weight": weight}

    return {
        "spec_version": 1,
        "kind": "lm_checkpoint",
        "name": "checkpoints/quickstart",
        "version": "warm-start-dev",
        "fingerprint": "warm-start",
        "output_path": str(output),
        "config": {
            "model": {"max_seq_len": 256, "hidden_dim": 128, "intermediate_dim": 512,
                      "num_heads": 4, "num_kv_heads": 2, "num_layers": 2, "rope_theta": 10000.0,
                      "norm_eps": 1e-5, "tie_embeddings": False, "init_std": 0.02},
            "optimizer": {"learning_rate": 3e-3, "weight_decay": 0.033, "beta1": 0.9,
                          "beta2": 0.95, "epsilon": 1e-8, "max_grad_norm": 1.0, "warmup": 50,
                          "decay": None, "min_lr_ratio": 0.1, "lr_schedule": "cosine"},
            "datasets": [dataset("train", 1.0)],
            "validation": [dataset("validation")],
            "batch_size": 16,
            "seq_len": 128,
            "num_train_steps": 400,
            "z_loss_weight": 1e-4,
            "evals": {"tasks": [{"name": "kiln_stdlib_mc", "num_fewshot": 0, "alias": None}],
                      "every": 400, "task_paths": [str(EVAL_TASKS)]},
            "seed": 0,
            "compute_dtype": "float32",
            "param_dtype": "float32",
        },  # fmt: skip
        "runtime": {
            "resources": {"kind": "cpu"},
            "mesh": {"data": -1, "fsdp": 1, "tensor": 1},
            "attention": "auto",
            "gradient_checkpointing": "none",
            "per_device_parallelism": None,
            "validation_every": 40,
            "max_eval_batches": 12,
            "checkpointer": {"save_interval_minutes": 1, "keep_last_temporary": 2,
                             "every": 10000, "temporary_base_path": None},
            "wandb": {"mode": "disabled", "project": "kiln", "entity": None, "run_id": None,
                      "group": None, "tags": []},
            "control": {"enabled": False, "host": "127.0.0.1", "port": 0,
                        "token_ttl_minutes": 720},
            "progress": "log",
            "max_steps_this_run": 1,
            "validate_at_start": False,
            "validation_names": {},
        },  # fmt: skip
    }


def measure(label: str, output: Path, caches: dict[str, Path], store: Path) -> dict[str, Any]:
    """One trainer process for one step; seconds from its start to its first step done."""
    output.mkdir(parents=True, exist_ok=True)
    spec_path = output.parent / f"{output.name}.json"
    spec_path.write_text(json.dumps(quickstart_spec(output, caches)))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
        "JAX_PLATFORMS": "cpu",
        "JAX_COMPILATION_CACHE_DIR": str(store / ".kiln/jax-cache"),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
    }
    started = time.monotonic()
    process = subprocess.Popen(
        [sys.executable, "-m", "kiln.train", str(spec_path), "--quiet"], env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    row: dict[str, Any] = {"label": label}
    assert process.stdout is not None
    output_lines = []
    for line in process.stdout:
        output_lines.append(line)
        if line.startswith(FIRST_STEP_LINE) and "to_first_step" not in row:
            row["to_first_step"] = time.monotonic() - started
    exit_code = process.wait()
    resumed = any(line.startswith("resumed from") for line in output_lines)
    # 3: stopped after max_steps_this_run, as asked; a restart must have resumed.
    if exit_code != 3 or "to_first_step" not in row or resumed != label.endswith("restart"):
        raise SystemExit(f"{label}: the trainer exited {exit_code}:\n{''.join(output_lines)}")
    summary = json.loads((output / "summary.json").read_text())
    row["first_step"] = summary["first_step_seconds"]
    row["program"] = summary["first_step_program"]
    print(f"{label}: {row['to_first_step']:.1f}s", flush=True)
    return row


def print_table(rows: list[dict[str, Any]]) -> None:
    print("\n| run | to first step s | first step s | start-up s | first step's program |")
    print("| --- | --- | --- | --- | --- |")
    for row in rows:
        print(
            f"| {row['label']} | {row['to_first_step']:.1f} | {row['first_step']:.2f} | "
            f"{row['to_first_step'] - row['first_step']:.1f} | {row['program']} |"
        )
    by_label = {row["label"]: row["to_first_step"] for row in rows}
    start_ratio = by_label["cold start"] / by_label["warm start"]
    restart_ratio = by_label["cold restart"] / by_label["warm restart"]
    warm = by_label["warm restart"]
    verdict = "met" if warm <= GOAL_SECONDS else "not met"
    print(f"\ncold/warm to first step: start {start_ratio:.2f}x, restart {restart_ratio:.2f}x")
    print(f"goal: warm restart to first step <= {GOAL_SECONDS:.0f} s: {warm:.1f} s, {verdict}")


if __name__ == "__main__":
    main()
