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

from kiln_testing.processes import python_env  # noqa: E402
from kiln_testing.training import build_tiny_cache, make_spec  # noqa: E402

HEADER = {"X-Levanter-Training-Control": "request-checkpoint"}
WAIT_SECONDS = 120  # a generous bound for a loaded 2-core machine; not a timing assertion
# Credentials in the trainer's environment, under names in no list of the redactor's: none may
# reach the page, the trainer's output or any file of the run.
PLANTED_SECRETS = {
    "LDAP_BINDPW": "ldapBindValue31415",
    "GIT_SIGNINGKEY": "signingKeyValue27182",
    "BUILD_LABEL": "q8ZxLm2NvKp4RtYw7sHj1Fd",
    "NOTIFY": "https://hooks.chat.example/services/T0A1B2C3D/B0A1B2C3D/Wq7Lm2NvKp4RtYw8sHj1Fd",
    "DOWNLOAD": "https://cdn.example/f.tar?expires=1700000000&sig=Zx81kLmQ0pWnR7tYbV3cA9",
}


def _train_spec(root: Path, output: Path) -> dict[str, Any]:
    """The shared tiny-run spec, stretched so that only the test's SIGTERM ends it and only the
    requested checkpoint is saved."""
    cache = build_tiny_cache(root, "tokenized/control-test", 200, seed=0)
    return make_spec(
        output,
        {"tokenized/control-test": cache},
        {},
        **{
            "config.model.max_seq_len": 32,
            "config.seq_len": 32,
            "config.batch_size": 2,
            "config.num_train_steps": 100_000,
            "config.z_loss_weight": None,
            "runtime.attention": "xla",
            "runtime.validation_every": 100_000,
            "runtime.max_eval_batches": 1,
            "runtime.checkpointer.save_interval_minutes": 10_000,
            "runtime.checkpointer.keep_last_temporary": 5,
            "runtime.checkpointer.every": None,
            "runtime.control.enabled": True,
            "runtime.control.token_ttl_minutes": 10,
        },
    )


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
    spec_path.write_text(json.dumps(_train_spec(tmp_path, output)))
    env = python_env(**PLANTED_SECRETS)
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
    said = f"saved temporary checkpoint {output}/checkpoints/step-{saved_step} (asked for at the "
    assert said + "control endpoint; training held up " in remaining_output, remaining_output
    assert not (output / "control" / "key").exists()  # the trainer stopped the server
    _assert_no_planted_secret(page, remaining_output, output)


def _assert_no_planted_secret(page: bytes, printed: str, output: Path) -> None:
    files = {p: p.read_bytes() for p in output.rglob("*") if p.is_file()}
    assert files  # config.json, metrics.jsonl, checkpoints...
    for name, secret in PLANTED_SECRETS.items():
        for where, text in [("page", page), ("output", printed.encode()), *files.items()]:
            assert secret.encode() not in text, f"{name}'s value is in {where}"
        assert name.encode() in page  # the variable is listed, its value hidden
