"""What a fanned-out cache sends its Ray tasks (no cluster needed); the build itself runs on the
end-to-end tests' cluster (tests/e2e/test_cluster_jobs.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from kiln_testing.data import STDLIB_TOKENIZER, make_spec, write_corpus

from kiln.cluster.errors import ClusterError
from kiln.cluster.fanout import TASK_RECORD, TASK_SPEC, check_cpus, hub_environment, task_files
from kiln.data.errors import SpecError
from kiln.data.spec import parse_cache_spec


def test_the_files_the_spec_reads_here_travel_and_absolute_ones_stay(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_corpus(tmp_path / "data")
    shutil.copytree(STDLIB_TOKENIZER["path"], tmp_path / "tok")
    (tmp_path / "record.json").write_text("{}")
    raw = make_spec({"kind": "files", "paths": ["data/*.jsonl", str(tmp_path / "data/a.jsonl")]})
    raw["config"]["tokenizer"] = {"kind": "local", "path": "tok"}
    monkeypatch.chdir(tmp_path)

    files = task_files(parse_cache_spec(raw), b"SPEC", Path("record.json"))
    tokenizer = [str(p.relative_to(tmp_path)) for p in (tmp_path / "tok").rglob("*") if p.is_file()]
    assert sorted(files) == sorted([TASK_SPEC, TASK_RECORD, "data/a.jsonl", "data/b.jsonl",
                                    "data/c.jsonl", *tokenizer])  # fmt: skip
    assert files[TASK_SPEC] == b"SPEC" and files["data/b.jsonl"] == Path("data/b.jsonl").read_bytes()

    absolute = make_spec({"kind": "files", "paths": [str(tmp_path / "data/*.jsonl")]})
    assert sorted(task_files(parse_cache_spec(absolute), b"{}", None)) == [TASK_SPEC]

    (tmp_path / "inner").mkdir()
    monkeypatch.chdir(tmp_path / "inner")
    above = make_spec({"kind": "files", "paths": ["../data/a.jsonl"]})
    with pytest.raises(SpecError, match=r"^\.\./data/a\.jsonl: a cache tokenized on a cluster"):
        task_files(parse_cache_spec(above), json.dumps(above).encode(), None)


def test_hub_credentials_travel_and_this_machines_folders_do_not() -> None:
    environ = {"HF_TOKEN": "hf_secret", "HF_HOME": "/home/me/.cache/hf", "HF_HUB_OFFLINE": "1",
               "HF_HUB_CACHE": "/home/me/hub", "HF_ENDPOINT": "", "PATH": "/bin"}  # fmt: skip
    assert hub_environment(environ) == {"HF_HUB_OFFLINE": "1", "HF_TOKEN": "hf_secret"}


def test_a_cluster_without_a_cpu_is_refused_at_once() -> None:
    gpu_only = {"Alive": True, "Resources": {"GPU": 1.0}}
    dead = {"Alive": False, "Resources": {"CPU": 4.0}}
    with pytest.raises(ClusterError, match="at ray://h:1 has no alive node with 1 CPU"):
        check_cpus([gpu_only, dead], "ray://h:1")
    check_cpus([gpu_only, {"Alive": True, "Resources": {"CPU": 1.0}}], "ray://h:1")
