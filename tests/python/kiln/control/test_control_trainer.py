"""The real trainer (`python -m kiln.train`) serves the endpoint; a checkpoint request over HTTP
makes it save once, after the step in flight, and it keeps training."""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from kiln.data.tokenize import build_cache  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[4]
TOKENIZER = {"kind": "local", "path": str(REPO_ROOT / "experiments/tokenizers/kiln-stdlib-8k")}
HEADER = {"X-Levanter-Training-Control": "request-checkpoint"}
WAIT_SECONDS = 120  # a generous bound for a loaded 2-core machine; not a timing assertion


def _tiny_cache(root: Path) -> Path:
    words = "the trainer reads windows of tokens and saves a checkpoint when asked to".split()
    texts = [
        " ".join(words[(i * 3 + j) % len(words)] for j in range(20 + i % 15)) for i in range(200)
    ]
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    spec = {
        "spec_version": 1,
        "kind": "tokenized_cache",
        "name": "tokenized/control-test",
        "version": "1",
        "fingerprint": "00",
        "config": {"source": {"kind": "files", "paths": [str(corpus)]}, "tokenizer": TOKENIZER},
    }
    return build_cache(spec, root / "cache")


def _train_spec(cache: Path, output: Path) -> dict[str, Any]:
    identity = {"version": "1", "fingerprint": "00"}
    return {
        "spec_version": 1,
        "kind": "lm_checkpoint",
        "name": "checkpoints/control-test",
        **identity,
        "output_path": str(output),
        "config": {
            "model": {
                "max_seq_len": 32,
                "hidden_dim": 32,
                "intermediate_dim": 64,
                "num_heads": 2,
                "num_kv_heads": 1,
                "num_layers": 1,
                "rope_theta": 10000.0,
                "norm_eps": 1e-5,
                "tie_embeddings": False,
                "init_std": 0.02,
            },
            "optimizer": {
                "learning_rate": 1e-3,
                "weight_decay": 0.0,
                "beta1": 0.9,
                "beta2": 0.95,
                "epsilon": 1e-8,
                "max_grad_norm": 1.0,
                "warmup": 0,
                "decay": None,
                "min_lr_ratio": 0.1,
                "lr_schedule": "cosine",
            },
            "datasets": [
                {"name": "tokenized/control-test", **identity, "weight": 1.0, "path": str(cache)}
            ],
            "validation": [],
            "batch_size": 2,
            "seq_len": 32,
            "num_train_steps": 100_000,  # stopped by the test with SIGTERM
            "z_loss_weight": None,
            "evals": None,
            "seed": 0,
            "compute_dtype": "float32",
            "param_dtype": "float32",
        },
        "runtime": {
            "resources": {"kind": "cpu"},
            "mesh": {"data": -1, "fsdp": 1, "tensor": 1},
            "attention": "xla",
            "gradient_checkpointing": "none",
            "validation_every": 100_000,
            "validation_batches": 1,
            "checkpointer": {
                "save_interval_minutes": 10_000,  # no time-based saves: only the requested one
                "keep_last_temporary": 5,
                "every": None,
                "temporary_base_path": None,
            },
            "wandb": {"mode": "disabled", "project": "kiln", "entity": None, "run_id": None},
            "control": {"enabled": True, "host": "127.0.0.1", "port": 0, "token_ttl_minutes": 10},
            "progress": "log",
            "max_steps_this_run": None,
        },
    }


def _request(
    url: str, method: str = "GET", headers: dict[str, str] | None = None
) -> tuple[int, bytes]:
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    try:
        connection.request(method, parts.path, headers=headers or {})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def _wait_for(condition: Callable[[], Any], what: str) -> Any:
    deadline = time.monotonic() + WAIT_SECONDS
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(0.1)
    pytest.fail(f"gave up waiting for {what}")


def _control_url(trainer: subprocess.Popen) -> str:
    assert trainer.stdout is not None
    for line in trainer.stdout:
        if "training control:" in line:
            return line.split("training control:", 1)[1].strip()
    pytest.fail(f"the trainer exited ({trainer.wait()}) without printing its control URL")


def _step(url: str) -> int:
    status, body = _request(url + "healthz")
    assert status == 200, body
    return json.loads(body)["step"] or 0


def test_checkpoint_requested_over_http_is_saved_once(tmp_path: Path) -> None:
    output = tmp_path / "run"
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(_train_spec(_tiny_cache(tmp_path), output)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    trainer = subprocess.Popen(
        [sys.executable, "-m", "kiln.train", str(spec_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        url = _control_url(trainer)
        for _ in range(3):
            assert _request(url + "checkpoint", "POST", HEADER)[0] == 202
        saved = _wait_for(lambda: list(output.glob("checkpoints/step-*/metadata.json")), "a save")
        saved_step = json.loads(saved[0].read_text())["step"]
        assert json.loads(saved[0].read_text())["is_temporary"] is True
        _wait_for(lambda: _step(url) >= saved_step + 2, "two more steps")
        assert len(list(output.glob("checkpoints/step-*"))) == 1  # three requests, one save
        status, page = _request(url)
        assert status == 200 and f"step-{saved_step}".encode() in page
    finally:
        trainer.terminate()
        remaining_output = trainer.communicate(timeout=WAIT_SECONDS)[0]
    assert trainer.returncode != 0 and "interrupted" in remaining_output
    assert not (output / "control" / "key").exists()  # the trainer stopped the server
