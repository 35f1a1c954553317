"""The hub settings file the Pants backend mounts into tokenize processes (kiln_pants.hub_settings)
reaches the environment before huggingface_hub is imported, and never overrides the caller's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from kiln_testing.processes import python_env

import kiln.data.tokenize  # noqa: F401 (the entry point the subprocess runs)
from kiln.data.hub_settings import apply_hub_settings
from kiln_contract.tokenize import HUB_SETTINGS_DIR, hub_settings_file


def test_settings_fill_the_environment_but_do_not_override_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "settings.json"
    path.write_text(
        json.dumps({"HF_TOKEN": "hf_file", "HF_ENDPOINT": "http://127.0.0.1:9", "OTHER": "x"})
    )
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://mirror.example")
    monkeypatch.delenv("OTHER", raising=False)
    assert apply_hub_settings(path) == ["HF_TOKEN"]
    assert os.environ["HF_TOKEN"] == "hf_file"
    assert os.environ["HF_ENDPOINT"] == "http://mirror.example"
    assert "OTHER" not in os.environ
    assert apply_hub_settings(tmp_path / "missing.json") == []


def test_the_tokenize_entry_point_reads_them_before_huggingface_hub(tmp_path: Path) -> None:
    """huggingface_hub reads HF_ENDPOINT once, at import: the entry point must set it first."""
    # The probe's parent is this test's process, as a tokenize process's is the Pants process.
    settings = tmp_path / HUB_SETTINGS_DIR / hub_settings_file(os.getpid())
    settings.parent.mkdir()
    settings.write_text(json.dumps({"HF_ENDPOINT": "http://127.0.0.1:9"}))
    probe = (
        "import sys, kiln.data.tokenize as t\n"
        "try:\n    t.main(['build', 'missing-spec.json', '--out', 'out'])\n"
        "except SystemExit:\n    pass\n"
        "from huggingface_hub import constants\n"
        "print(constants.ENDPOINT)\n"
    )
    env = python_env()
    env.pop("HF_ENDPOINT", None)
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert result.stdout.strip().splitlines()[-1:] == ["http://127.0.0.1:9"], result.stderr[-3000:]
