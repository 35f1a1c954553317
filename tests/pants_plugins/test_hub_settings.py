"""HF_TOKEN and the other hub variables reach tokenize processes through a named cache, never
through their env (which Pants hashes into the cache key)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

from pants.engine.rules import QueryRule
from pants.testutil.rule_runner import RuleRunner

from kiln_contract.tokenize import HUB_SETTINGS_CACHE, HUB_SETTINGS_DIR, hub_settings_file
from kiln_pants import hub_settings
from kiln_pants.hub_settings import HubSettingsCache


def test_the_settings_file_holds_the_variables_and_the_mount_does_not(tmp_path: Path) -> None:
    rule_runner = RuleRunner(
        rules=[*hub_settings.rules(), QueryRule(HubSettingsCache, [])],
    )
    caches = tmp_path / "named_caches"
    env = {"HF_TOKEN": "hf_secret_value", "HF_HOME": "/data/hf", "WANDB_API_KEY": "other"}
    rule_runner.set_options([f"--named-caches-dir={caches}"], env=env)
    mount = rule_runner.request(HubSettingsCache, [])
    assert dict(mount.append_only_caches) == {HUB_SETTINGS_CACHE: HUB_SETTINGS_DIR}
    assert "hf_secret_value" not in repr(mount)

    settings = caches / HUB_SETTINGS_CACHE / hub_settings_file(os.getpid())  # the rule's process
    assert json.loads(settings.read_text()) == {"HF_HOME": "/data/hf", "HF_TOKEN": "hf_secret_value"}
    assert stat.S_IMODE(settings.stat().st_mode) == 0o600

    # Unsetting the token removes it from the file.
    rule_runner.set_options([f"--named-caches-dir={caches}"], env={"HF_HOME": "/data/hf"})
    rule_runner.request(HubSettingsCache, [])
    assert json.loads(settings.read_text()) == {"HF_HOME": "/data/hf"}


def test_another_token_mounts_the_same_cache(tmp_path: Path) -> None:
    """The mount is what a tokenize process's cache key sees of the hub settings: the same
    for every token, or none."""
    rule_runner = RuleRunner(rules=[*hub_settings.rules(), QueryRule(HubSettingsCache, [])])
    mounts = []
    for token in ("hf_first_token", "hf_second_token", None):
        env = {"HF_TOKEN": token} if token else {}
        rule_runner.set_options([f"--named-caches-dir={tmp_path}"], env=env)
        mounts.append(rule_runner.request(HubSettingsCache, []))
    assert mounts[0] == mounts[1] == mounts[2]


def test_each_pants_process_writes_its_own_file_and_ended_ones_are_removed(tmp_path: Path) -> None:
    """Two `./pants` runs with other settings at once (two terminals, two tests) do not read
    each other's: a tokenize process reads its parent's file."""
    folder = tmp_path / HUB_SETTINGS_CACHE
    gone = subprocess.Popen(["true"])
    gone.wait()
    hub_settings.write_hub_settings(folder, {"HF_TOKEN": "hf_gone"}, gone.pid)
    hub_settings.write_hub_settings(folder, {"HF_TOKEN": "hf_other"}, os.getppid())  # alive
    hub_settings.write_hub_settings(folder, {"HF_TOKEN": "hf_mine"}, os.getpid())
    files = {path.name: json.loads(path.read_text()) for path in folder.iterdir()}
    assert files == {
        hub_settings_file(os.getppid()): {"HF_TOKEN": "hf_other"},
        hub_settings_file(os.getpid()): {"HF_TOKEN": "hf_mine"},
    }
