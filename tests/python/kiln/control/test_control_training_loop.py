"""A real process running a training loop serves the endpoint; a checkpoint request over HTTP
makes it write exactly one checkpoint, and the mint CLI gives a working URL for it."""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

from kiln_testing.processes import python_env

TOY_LOOP = Path(__file__).parent / "toy_training_loop.py"
HEADER = {"X-Levanter-Training-Control": "request-checkpoint"}


def _status(url: str, method: str = "GET", headers: dict[str, str] | None = None) -> int:
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
    try:
        connection.request(method, parts.path, headers=headers or {})
        return connection.getresponse().status
    finally:
        connection.close()


def _child_env() -> dict[str, str]:
    # The child must import kiln exactly as this test does (a dev checkout or a Pants sandbox).
    return python_env()


def test_checkpoint_request_reaches_a_running_loop(tmp_path: Path) -> None:
    # Steps of half a second: the three requests below reach the loop within one step even on a
    # loaded machine (with 20 ms steps they sometimes straddled two, and the loop saved twice).
    loop = subprocess.Popen(
        [sys.executable, str(TOY_LOOP), str(tmp_path), "400", "0.5"],
        stdout=subprocess.PIPE,
        text=True,
        env=_child_env(),
    )
    try:
        assert loop.stdout is not None
        url = loop.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:") and "/c/" in url

        minted = subprocess.run(
            [sys.executable, "-m", "kiln.control", "mint", str(tmp_path), "--ttl-minutes", "5"],
            capture_output=True,
            text=True,
            env=_child_env(),
            check=True,
        ).stdout.strip()
        assert minted != url and minted.split("/c/")[0] == url.split("/c/")[0]
        assert _status(minted) == 200

        for _ in range(3):  # several requests before the loop's next step: one save
            assert _status(minted + "checkpoint", "POST", HEADER) == 202
        saved = json.loads(loop.stdout.readline())
        checkpoint = tmp_path / "checkpoints" / f"step-{saved['saved']}" / "metadata.json"
        assert json.loads(checkpoint.read_text())["step"] == saved["saved"]
    finally:
        loop.terminate()
        loop.wait(timeout=10)
    saves = list((tmp_path / "checkpoints").glob("step-*"))
    assert len(saves) == 1, saves
    assert not (tmp_path / "control" / "key").exists()  # the server stopped and removed its key


def test_mint_explains_a_missing_endpoint(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kiln.control", "mint", str(tmp_path)],
        capture_output=True,
        text=True,
        env=_child_env(),
    )
    assert result.returncode == 1
    assert "endpoint.json does not exist" in result.stderr
    assert "Traceback" not in result.stderr


def test_mint_refuses_when_the_run_was_killed(tmp_path: Path) -> None:
    loop = subprocess.Popen(
        [sys.executable, str(TOY_LOOP), str(tmp_path), "400", "0.02"],
        stdout=subprocess.PIPE,
        text=True,
        env=_child_env(),
    )
    assert loop.stdout is not None
    assert "/c/" in loop.stdout.readline()
    loop.kill()  # SIGKILL: no cleanup, endpoint.json and the key stay behind
    loop.wait(timeout=10)
    assert (tmp_path / "control" / "endpoint.json").exists()
    result = subprocess.run(
        [sys.executable, "-m", "kiln.control", "mint", str(tmp_path)],
        capture_output=True,
        text=True,
        env=_child_env(),
    )
    assert result.returncode == 1
    assert f"(pid {loop.pid}) is not running" in result.stderr
