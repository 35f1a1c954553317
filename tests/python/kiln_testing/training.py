"""Helpers for the trainer's tests: tiny token caches and train step specs."""

from __future__ import annotations

import copy
import json
import os
import random
import tempfile
from pathlib import Path
from typing import Any

import jax
from kiln_testing.data import STDLIB_TOKENIZER

# Before anything imports huggingface_hub / transformers (they read these once): never go online.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

# Every test trains the same tiny model: compile it once per machine, not once per test (this is
# jax's own persistent cache; subprocesses get it through the environment).
JAX_CACHE_DIR = Path(tempfile.gettempdir()) / "kiln-tests-jax-cache"
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(JAX_CACHE_DIR))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)

WORDS = (
    "the model reads a window of tokens from the cache and predicts the next one while the "
    "optimizer lowers the loss step by step over shards of python documentation"
).split()


def build_tiny_cache(
    folder: Path, name: str, num_documents: int, seed: int, tokenizer: dict | None = None
) -> Path:
    """A real token cache (kiln.data.tokenize.build_cache) of generated sentences."""
    from kiln.data.tokenize import build_cache

    rng = random.Random(seed)
    slug = name.replace("/", "_")
    source = folder / f"{slug}.jsonl"
    folder.mkdir(parents=True, exist_ok=True)
    with source.open("w") as f:
        for _ in range(num_documents):
            text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 50)))
            f.write(json.dumps({"text": text.capitalize() + "."}) + "\n")
    spec = {
        "spec_version": 1,
        "kind": "tokenized_cache",
        "name": name,
        "version": "2026.11.29",
        "fingerprint": f"fp-{slug}",
        "config": {
            "source": {"kind": "files", "paths": [str(source)], "format": "auto"},
            "tokenizer": tokenizer or STDLIB_TOKENIZER,
            "text_key": "text",
            "max_document_chars": 100_000,
            "num_shards": 2,
        },
    }
    return build_cache(spec, folder / slug)


def dataset_entry(name: str, path: Path, weight: float | None = None) -> dict[str, Any]:
    entry = {"name": name, "version": "2026.11.29", "fingerprint": f"fp-{name}", "path": str(path)}
    return entry if weight is None else {**entry, "weight": weight}


EXAMPLE_SPEC: dict[str, Any] = {
    "spec_version": 1,
    "kind": "lm_checkpoint",
    "name": "checkpoints/tiny",
    "version": "2026.11.29",
    "fingerprint": "1a2b3c4d",
    "output_path": "/tmp/kiln-never-written",
    "config": {
        "model": {
            "max_seq_len": 64,
            "hidden_dim": 64,
            "intermediate_dim": 128,
            "num_heads": 4,
            "num_kv_heads": 2,
            "num_layers": 2,
            "rope_theta": 10000.0,
            "norm_eps": 1e-5,
            "tie_embeddings": False,
            "init_std": 0.02,
        },
        "optimizer": {
            "learning_rate": 3e-3,
            "weight_decay": 0.033,
            "beta1": 0.9,
            "beta2": 0.95,
            "epsilon": 1e-8,
            "max_grad_norm": 1.0,
            "warmup": 3,
            "decay": None,
            "min_lr_ratio": 0.1,
            "lr_schedule": "cosine",
        },
        "datasets": [dataset_entry("tokenized/a", Path("/data/a"), 3.8)],
        "validation": [dataset_entry("tokenized/val", Path("/data/val"))],
        "batch_size": 4,
        "seq_len": 64,
        "num_train_steps": 12,
        "z_loss_weight": 1e-4,
        "evals": None,
        "seed": 0,
        "compute_dtype": "float32",
        "param_dtype": "float32",
    },
    "runtime": {
        "resources": {"kind": "cpu"},
        "mesh": {"data": -1, "fsdp": 1, "tensor": 1},
        "attention": "auto",
        "gradient_checkpointing": "none",
        "per_device_parallelism": None,
        "validation_every": 6,
        "max_eval_batches": 2,
        "checkpointer": {
            "save_interval_minutes": 10,
            "keep_last_temporary": 2,
            "every": 5,
            "temporary_base_path": None,
            "per_host_folders": False,
        },
        "wandb": {"mode": "disabled", "project": "kiln", "entity": None, "run_id": None,
                  "group": None, "tags": []},
        "control": {"enabled": False, "host": "127.0.0.1", "port": 0, "token_ttl_minutes": 720},
        "progress": "log",
        "max_steps_this_run": None,
        "validate_at_start": False,
        "validation_names": {},
    },
}


def make_spec(
    output_path: Path, caches: dict[str, Path], validation: dict[str, Path], **overrides: Any
) -> dict[str, Any]:
    """EXAMPLE_SPEC with these caches ({name: path}; weights from `weights`) and overrides given
    as dotted paths: make_spec(out, ..., **{"config.num_train_steps": 4})."""
    spec = copy.deepcopy(EXAMPLE_SPEC)
    spec["output_path"] = str(output_path)
    weights = overrides.pop("weights", {})
    spec["config"]["datasets"] = [
        dataset_entry(name, path, weights.get(name, 1.0)) for name, path in caches.items()
    ]
    spec["config"]["validation"] = [dataset_entry(n, p) for n, p in validation.items()]
    for dotted, value in overrides.items():
        set_field(spec, dotted, value)
    return spec


def _parent(spec: dict[str, Any], dotted: str) -> tuple[Any, Any]:
    """(container, key) of a dotted path; numeric parts index lists."""
    *parents, last = (int(k) if k.isdigit() else k for k in dotted.split("."))
    target = spec
    for key in parents:
        target = target[key]
    return target, last


def set_field(spec: dict[str, Any], dotted: str, value: Any) -> None:
    target, key = _parent(spec, dotted)
    target[key] = value


def delete_field(spec: dict[str, Any], dotted: str) -> None:
    target, key = _parent(spec, dotted)
    del target[key]


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


EVAL_TASK = "kiln_trainer_mc"


def write_eval_task(folder: Path, data_from: Path | None = None) -> Path:
    """A local multiple-choice lm-eval task (YAML + JSONL, no hub); returns its folder. The YAML
    names its data by absolute path, or relative to `data_from` (the working directory of the
    run that reads it, as experiments/eval_tasks names its data relative to the repository)."""
    folder.mkdir(parents=True, exist_ok=True)
    docs = [
        {
            "query": "The model reads a window of",
            "choices": ["tokens", "shards", "loss"],
            "gold": 0,
        },
        {"query": "The optimizer lowers the", "choices": ["cache", "loss", "window"], "gold": 1},
        {"query": "Documentation of", "choices": ["step", "one", "python"], "gold": 2},
    ]
    (folder / "mc.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    named = folder if data_from is None else folder.relative_to(data_from)
    (folder / f"{EVAL_TASK}.yaml").write_text(
        f"task: {EVAL_TASK}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {named / 'mc.jsonl'}\n  cache_dir: {named / 'hf_cache'}\n"
        "output_type: multiple_choice\ntest_split: test\n"
        'doc_to_text: "{{query}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{gold}}"\n'
        "metric_list:\n  - {metric: acc, aggregation: mean, higher_is_better: true}\n"
        "metadata:\n  version: 1.0\n"
    )
    return folder


def write_runner_step(root: Path, tokenizer: dict | None = None, **overrides: Any) -> Path:
    """A step JSON for `python -m kiln.runner`, as the Pants backend writes it (docs/step-spec.md):
    EXAMPLE_SPEC with `overrides` (dotted paths, as make_spec), its two tiny caches built under
    root (with `tokenizer`, default the quickstart's) with their artifact records (as
    `merge --record` places them) and named by their location there (`--inputs root`). Returns
    the step file's path."""
    caches = {
        "tokenized/a": build_tiny_cache(root, "tokenized/a", 120, seed=0, tokenizer=tokenizer),
        "tokenized/val": build_tiny_cache(root, "tokenized/val", 30, seed=2, tokenizer=tokenizer),
    }
    spec = make_spec(
        root / "unused", {"tokenized/a": caches["tokenized/a"]},
        {"tokenized/val": caches["tokenized/val"]}, **overrides,
    )  # fmt: skip
    entries = spec["config"]["datasets"] + spec["config"]["validation"]
    for entry in entries:
        del entry["path"]  # a step names its caches; the runner finds them under --inputs
    records = {e["name"]: _record(e["name"], e["fingerprint"], "tokenized_cache", {}) for e in entries}
    for name, record in records.items():
        (caches[name] / "artifact.json").write_text(json.dumps(record))
    inputs: list[dict[str, Any]] = [
        {"ref": f"{e['name']}@{e['version']}", "name": e["name"], "version": e["version"],
         "record": records[e["name"]], "location": caches[e["name"]].name}
        for e in entries
    ]  # fmt: skip
    identity = {"kind": "lm_checkpoint", "config": spec["config"]}
    step = {
        "step_version": 1, "kind": "lm_checkpoint", "name": spec["name"],
        "version": spec["version"], "fingerprint": spec["fingerprint"],
        "record": _record(spec["name"], spec["fingerprint"], "lm_checkpoint", identity),
        "config": spec["config"], "runtime": spec["runtime"], "inputs": inputs,
        "provenance": {"code_digest": "a" * 64, "lockfile_digest": "b" * 64},
    }  # fmt: skip
    path = root / "step.json"
    path.write_text(json.dumps(step))
    return path


def _record(name: str, fingerprint: str, kind: str, identity: dict[str, Any]) -> dict[str, Any]:
    return {"record_version": 1, "kind": kind, "name": name, "version": "2026.11.29",
            "fingerprint": fingerprint, "identity": identity, "inputs": []}  # fmt: skip
