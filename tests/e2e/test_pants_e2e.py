"""End to end: real ./pants on a copy of this workspace, building the tiny CI checkpoint.

In the e2e tests' shared workspace (conftest.py): build a copy of it, build it again (every
process a cache hit of Pants' local cache: without pantsd, whose memory would answer first), then
change one identity field and edit the trainer's code: training reruns, tokenization (whose
processes never see trainer code) stays a cache hit; the edits are undone when it ends. Through
the workspace's pantsd: `store` caches build in the artifact store, and once built start no process; two
`pants run`s, one per "host", train the checkpoint as one multi-host run into the artifact store,
and its `hf_model` exports it from there; `pants build` of several roots goes on past a failed
step, marks its dependents DEP_FAILED, and `plan` says why the step failed; `pants store` lists
the store and removes what no target names and what failed.
"""

from __future__ import annotations

import json
import random
import re
import socket
import subprocess
import uuid
from pathlib import Path

import pytest

from kiln_contract.train import CPU_MALLOC_TUNABLES
from tests.e2e.workspace import store_rows

TARGET = "experiments:ci_tiny"
TRAINING = "Training checkpoints/ci_tiny@2026.11.29"
HF_TARGET = "experiments:ci_tiny_hf"
TOKENIZING = "Tokenizing tokenized/quickstart/stdlib_validation@2026.11.29"


def pants_command(*args: str, daemon: bool = True) -> list[str]:
    return ["./pants", "--pantsd" if daemon else "--no-pantsd", "--stats-log", *args]


def pants(repo: Path, *args: str, daemon: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        pants_command(*args, daemon=daemon), cwd=repo, capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def counter(result: subprocess.CompletedProcess[str], name: str) -> int:
    match = re.search(rf"^\s+{name}: (\d+)$", result.stderr, re.MULTILINE)
    assert match, f"no {name} in the stats log:\n{result.stderr}"
    return int(match.group(1))


# What the test edits, put back when it ends: the shared workspace's other tests build ci_tiny.
EDITED = (
    "experiments/BUILD", "src/python/kiln/runner/__main__.py", "src/python/kiln/train/trainer.py"
)


def test_build_hit_and_rebuild_on_change(workspace: Path) -> None:
    repo = workspace
    originals = {name: (repo / name).read_text() for name in EDITED}
    try:
        _build_hit_and_rebuild(repo)
    finally:  # the shared workspace's files as they were, for the tests after this one
        for name, text in originals.items():
            (repo / name).write_text(text)


def _build_hit_and_rebuild(repo: Path) -> None:
    """Built through the workspace's daemon, served from Pants' persistent cache by a Pants
    without it (the daemon's memory would serve it otherwise), rebuilt by the daemon after an
    edit of the BUILD file and of Kiln's code."""
    # This machine's Pants cache may already hold this exact training process (an earlier run of
    # this test): make the runner's code unique to this run so the first build really builds.
    main = repo / "src/python/kiln/runner/__main__.py"
    main.write_text(main.read_text() + f"\n# e2e run {uuid.uuid4()}\n")
    artifact = repo / "dist/checkpoints/ci_tiny/2026.11.29"

    first = pants(repo, "package", TARGET)
    assert (artifact / "STATUS").read_text().strip() == "SUCCESS"
    record = json.loads((artifact / "artifact.json").read_text())
    assert record["name"] == "checkpoints/ci_tiny"
    assert record["identity"]["num_train_steps"] == 20
    assert (artifact / "checkpoints/step-20/metadata.json").exists()
    # Run-time BUILD fields reach the trainer: per_device_parallelism=2 on 1 device, batch 4.
    config = json.loads((artifact / "config.json").read_text())
    assert config["microbatches"] == 2
    assert config["glibc_tunables"] == CPU_MALLOC_TUNABLES  # the CPU allocator setting
    assert config["devices"]["platform"] == "cpu" and config["jax"]["version"] == "0.11.2"
    assert config["spec"]["runtime"]["mesh"] == {"data": 1, "fsdp": -1, "tensor": 1}
    # The harness ran the local lm-eval task (experiments/eval_tasks) at the last step.
    summary = json.loads((artifact / "summary.json").read_text())
    assert 0.0 <= summary["lm_eval/kiln_stdlib_mc/acc"] <= 1.0
    assert TRAINING in first.stderr

    second = pants(repo, "package", TARGET, daemon=False)
    assert TRAINING not in second.stderr and TOKENIZING not in second.stderr
    assert counter(second, "local_cache_requests_cached") >= 3  # 1 shard + merge + training

    build = repo / "experiments/BUILD"
    text = build.read_text()
    assert text.count("num_train_steps=20,") == 1
    build.write_text(text.replace("num_train_steps=20,", "num_train_steps=22,"))
    trainer = repo / "src/python/kiln/train/trainer.py"
    trainer.write_text(trainer.read_text() + "\n# An edit to the trainer's code.\n")
    third = pants(repo, "package", TARGET)
    assert TRAINING in third.stderr
    assert TOKENIZING not in third.stderr
    record = json.loads((artifact / "artifact.json").read_text())
    assert record["identity"]["num_train_steps"] == 22
    assert (artifact / "checkpoints/step-22/metadata.json").exists()


# dclm_1b's shape in small: store-mode training caches (several shards each) and inline
# validation caches, under one checkpoint.
SHAPED = """
for name, part, weight in [("web", "pydoc_topics", 0.7), ("code", "pydoc_topics", 0.2),
                           ("math", "pydoc_topics", 0.1)]:
    tokenized_cache(
        name=name,
        artifact_name=f"tokenized/{name}",
        source=f"stdlib:{part}",
        split="validation",
        tokenizer="//experiments/tokenizers:kiln-stdlib-8k",
        version="2026.11.29",
        num_shards=2,
        storage="store",
        tags=["cache"],
    )

for name in ["val_a", "val_b"]:
    tokenized_cache(
        name=name,
        artifact_name=f"tokenized/{name}",
        source="stdlib:pydoc_topics",
        split="validation",
        tokenizer="//experiments/tokenizers:kiln-stdlib-8k",
        version="2026.11.29",
        tags=["cache"],
    )

tokenized_cache(
    name="val_c",
    artifact_name="tokenized/val_c",
    sources=["val_c/*.jsonl"],
    tokenizer="//experiments/tokenizers:kiln-stdlib-8k",
    version="2026.11.29",
    num_shards=2,
    tags=["cache"],
)

lm_checkpoint(
    name="shaped",
    artifact_name="checkpoints/shaped",
    version="2026.11.29",
    model=llama(max_seq_len=64, hidden_dim=32, intermediate_dim=64, num_heads=2,
                num_kv_heads=1, num_layers=1),
    optimizer=adam(learning_rate=1e-2, warmup=2),
    datasets={":web": 0.7, ":code": 0.2, ":math": 0.1},
    validation=[":val_a", ":val_b", ":val_c"],
    batch_size=4,
    seq_len=64,
    num_train_steps=20,
    z_loss_weight=None,
    evals=None,
    resources=gpu("H100", count=8),
)
"""
SHAPED_CACHES = [f"experiments/shaped:{name}" for name in ("web", "code", "math")] + [
    f"experiments/shaped:{name}" for name in ("val_a", "val_b", "val_c")
]


def test_built_store_caches_are_served_without_a_process(workspace: Path) -> None:
    """Store caches build in the artifact store; once built, the Pants rule finds them there
    (artifact.json with their fingerprint, STATUS SUCCESS) and starts no shard or merge process."""
    repo = workspace
    (repo / "experiments/shaped").mkdir()
    (repo / "experiments/shaped/BUILD").write_text(SHAPED)
    texts = repo / "experiments/shaped/val_c"
    texts.mkdir()
    for name, documents in (("a", 12), ("b", 5)):
        lines = (json.dumps({"text": f"Held-out text {i} of {name}."}) for i in range(documents))
        (texts / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    sizes = {name: (texts / f"{name}.jsonl").stat().st_size for name in "ab"}
    store = repo / "artifacts/tokenized"

    first = pants(repo, "package", *SHAPED_CACHES)
    assert "Tokenizing tokenized/web@2026.11.29 shard 2/2" in first.stderr
    for name in ("web", "code", "math"):
        cache = store / name / "2026.11.29"
        assert (cache / "STATUS").read_text().strip() == "SUCCESS"
        record = json.loads((cache / "artifact.json").read_text())
        manifest = json.loads((repo / f"dist/tokenized/{name}/2026.11.29/manifest.json").read_text())
        assert manifest == {"store_path": str(cache), "fingerprint": record["fingerprint"]}
        assert not list((cache.parent / ".2026.11.29.shards").glob("shard-*"))
    files = {path: path.stat().st_mtime_ns for path in store.rglob("*")}

    second = pants(repo, "package", *SHAPED_CACHES)
    assert "Tokenizing" not in second.stderr and "Merging" not in second.stderr
    assert {path: path.stat().st_mtime_ns for path in store.rglob("*")} == files
    planned = pants(repo, "plan", "experiments/shaped:shaped")
    assert "Tokenizing" not in planned.stderr
    # Inline caches enter the store when a run places them there; until then they are Pants'.
    assert "7 artifacts: 3 built, 3 inline, 1 would run" in planned.stdout
    # Each unbuilt cache's shard plan, from the runtime: here val_c's local files, one a shard.
    assert planned.stdout.count("shard plan: ") == 3  # val_a, val_b and val_c; not the built ones
    assert f"shard plan: 2 shards, 2 files, {sum(sizes.values())} B;" in planned.stdout
    assert f"shard 0: 1 file, {sizes['a']} B: experiments/shaped/val_c/a.jsonl\n" in planned.stdout
    assert f"shard 1: 1 file, {sizes['b']} B: experiments/shaped/val_c/b.jsonl\n" in planned.stdout


@pytest.fixture(scope="module")
def trained_in_store(workspace: Path) -> tuple[Path, list[tuple[str, str]]]:
    """`pants run X -- --coordinator ...` on each "host" (here: two at once on one machine, one CPU
    device each, each a Pants of its own, as on two machines: host 0's the workspace's daemon,
    host 1's a Pants without one): the workspace, with ci_tiny in its artifact store, and each
    run's output."""
    repo = workspace
    coordinator = f"127.0.0.1:{unused_port()}"
    runs = [
        subprocess.Popen(
            pants_command("run", TARGET, "--", "--coordinator", coordinator,
                          "--num-processes", "2", "--process-id", str(i), daemon=i == 0),
            cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        for i in (0, 1)
    ]
    outputs = [run.communicate(timeout=900) for run in runs]
    assert [run.returncode for run in runs] == [0, 0], [err[-3000:] for _, err in outputs]
    return repo, outputs


def test_two_pants_runs_train_one_checkpoint_as_a_multihost_run(
    trained_in_store: tuple[Path, list[tuple[str, str]]],
) -> None:
    """One jax runtime, one artifact; process 0 holds the lease and writes STATUS."""
    repo, outputs = trained_in_store
    artifact = repo / "artifacts/checkpoints/ci_tiny/2026.11.29"
    assert (artifact / "STATUS").read_text().strip() == "SUCCESS"
    assert "kiln: built checkpoints/ci_tiny@2026.11.29" in outputs[0][0]
    assert "kiln: built" not in outputs[1][0]
    config = json.loads((artifact / "config.json").read_text())
    assert config["process_count"] == 2 and config["devices"]["count"] == 2
    assert config["glibc_tunables"] == CPU_MALLOC_TUNABLES  # given by `pants run` too
    argv = json.loads((artifact / "artifact.json").read_text())["provenance"]["argv"]
    assert argv[argv.index("--process-id") + 1] == "0"
    assert "Samples from step-20" in (artifact / "summary.txt").read_text()


def test_an_hf_model_exports_the_stored_checkpoint_into_the_store(
    trained_in_store: tuple[Path, list[tuple[str, str]]],
) -> None:
    from kiln.data.tokenizer import load_tokenizer
    from kiln.interop.read import read_hf_llama

    repo, _ = trained_in_store
    checkpoint = json.loads(
        (repo / "artifacts/checkpoints/ci_tiny/2026.11.29/artifact.json").read_text()
    )
    export = repo / "artifacts/hf/ci_tiny/2026.11.29"

    pants(repo, "package", HF_TARGET)
    assert (export / "STATUS").read_text().strip() == "SUCCESS"
    record = json.loads((export / "artifact.json").read_text())
    assert record["kind"] == "hf_model" and record["identity"]["dtype"] == "float32"
    assert record["inputs"] == [
        {"ref": "checkpoints/ci_tiny@2026.11.29", "fingerprint": checkpoint["fingerprint"]}
    ]
    manifest = json.loads((repo / "dist/hf/ci_tiny/2026.11.29/manifest.json").read_text())
    assert manifest == {"store_path": str(export), "fingerprint": record["fingerprint"]}
    tokenizer = load_tokenizer({"kind": "local", "path": str(export)})  # the exported one
    config = read_hf_llama(export, tokenizer=tokenizer.info).config
    assert (config.hidden_dim, config.num_layers, config.num_kv_heads) == (32, 1, 1)


BROKEN_CHECKPOINT = """
lm_checkpoint(
    name="broken",
    artifact_name="checkpoints/broken",
    version="2026.12.01",
    model=llama(max_seq_len=64, hidden_dim=32, intermediate_dim=64, num_heads=2, num_kv_heads=1,
                num_layers=1),
    optimizer=adam(learning_rate=1e-2, warmup=2),
    datasets={"//experiments:stdlib_validation": 1.0},
    validation=["//experiments:stdlib_validation"],
    batch_size=4,
    seq_len=64,
    num_train_steps=4,
    z_loss_weight=None,
    evals=None,
    resources=cpu(),
    init_from=hf_model_source("MISSING"),
)

hf_model(name="broken_hf", artifact_name="hf/broken", version="2026.12.01", checkpoint=":broken")

hf_model(name="bf16", artifact_name="hf/ci_tiny_bf16", version="2026.12.01",
         checkpoint="//experiments:ci_tiny")
"""


@pytest.fixture(scope="module")
def failed_build(
    trained_in_store: tuple[Path, list[tuple[str, str]]],
) -> tuple[Path, subprocess.CompletedProcess[str], Path]:
    """`pants build` of experiments/broken: the workspace, the build's result and the missing
    `init_from` folder."""
    repo, _ = trained_in_store
    (repo / "experiments/broken").mkdir()
    missing = repo / "no-such-model"
    (repo / "experiments/broken/BUILD").write_text(BROKEN_CHECKPOINT.replace("MISSING", str(missing)))
    result = subprocess.run(
        pants_command("build", "experiments/broken::"),
        cwd=repo, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    return repo, result, missing


def test_build_goes_on_past_a_failed_step_and_marks_its_dependents(
    failed_build: tuple[Path, subprocess.CompletedProcess[str], Path],
) -> None:
    """`pants build` of several roots: ci_tiny is served from the store and a bfloat16 export
    of it is built, while a checkpoint whose `init_from` folder is missing fails at train time
    (its log says why) and its export is DEP_FAILED; the goal counts the failures, exits 1."""
    repo, result, missing = failed_build
    store = repo / "artifacts"
    assert result.returncode == 1, result.stdout + result.stderr
    summary = dict(
        (match.group(2), match.group(1))
        for match in re.finditer(r"^(\w+) +(\S+@\S+) ", result.stderr, re.MULTILINE)
    )
    # The cache the workspace's first build made: served (Pants' cache, or pantsd's memory),
    # counted in one line; tokenized again only where neither holds it.
    cache = summary.pop("tokenized/quickstart/stdlib_validation@2026.11.29", None)
    assert cache == "SUCCESS" or "SERVED      1 cache(s), built before" in result.stderr
    assert summary == {
        "checkpoints/ci_tiny@2026.11.29": "SERVED",
        "checkpoints/broken@2026.12.01": "FAILED",
        "hf/ci_tiny_bf16@2026.12.01": "SUCCESS",
        "hf/broken@2026.12.01": "DEP_FAILED",
    }, result.stderr
    assert "2 step(s) failed (1 FAILED, 1 DEP_FAILED)" in result.stderr
    assert (store / "hf/ci_tiny_bf16/2026.12.01/STATUS").read_text().strip() == "SUCCESS"
    assert (store / "checkpoints/broken/2026.12.01/STATUS").read_text().strip() == "FAILED"
    assert (store / "hf/broken/2026.12.01/STATUS").read_text().strip() == "DEP_FAILED"
    log = repo / "dist/logs/checkpoints/broken/2026.12.01.log"
    assert f"log: {log}" in result.stderr
    assert f"init_from: {missing} is not a folder" in log.read_text()
    # `plan` says why, from failure.txt beside STATUS (the terminal that printed it is gone).
    planned = subprocess.run(pants_command("plan", "experiments/broken:broken"), cwd=repo,
                             capture_output=True, text=True, timeout=900)  # fmt: skip
    assert f"!! init_from: {missing} is not a folder" in planned.stdout, planned.stdout


def test_store_lists_the_artifacts_and_removes_the_unwanted(
    failed_build: tuple[Path, subprocess.CompletedProcess[str], Path],
) -> None:
    """`pants store` names each artifact's STATUS and target; after a version bump the old
    export is named by none: `--remove=unnamed` prints it and removes it only with `--yes`;
    `--remove=failed` takes the failed run and its DEP_FAILED export."""
    repo, _, _ = failed_build
    store = repo / "artifacts"
    rows = store_rows(pants(repo, "store").stdout)
    assert rows["checkpoints/ci_tiny@2026.11.29"] == ("SUCCESS", "experiments:ci_tiny")
    assert rows["checkpoints/broken@2026.12.01"] == ("FAILED", "experiments/broken:broken")
    assert rows["hf/broken@2026.12.01"] == ("DEP_FAILED", "experiments/broken:broken_hf")
    assert rows["hf/ci_tiny_bf16@2026.12.01"] == ("SUCCESS", "experiments/broken:bf16")

    build = repo / "experiments/broken/BUILD"
    build.write_text(build.read_text().replace('ci_tiny_bf16", version="2026.12.01"',
                                               'ci_tiny_bf16", version="2026.12.02"'))  # fmt: skip
    old_export = store / "hf/ci_tiny_bf16/2026.12.01"
    dry = pants(repo, "store", "--remove=unnamed").stdout
    assert store_rows(dry)["hf/ci_tiny_bf16@2026.12.01"] == ("SUCCESS", "(no target)")
    assert re.search(r"^  hf/ci_tiny_bf16@2026.12.01 \(SUCCESS, [\d.]+ [kM]B\)$", dry, re.M), dry
    assert "Nothing removed: add --store-yes to remove them." in dry
    assert (old_export / "STATUS").is_file()
    removed = pants(repo, "store", "--remove=unnamed", "--yes").stdout
    assert re.search(rf"^Removed (\d+) of \1 artifacts? from {store}\.$", removed, re.M), removed
    assert not old_export.exists() and not (old_export.parent / ".2026.12.01.lease").exists()

    failed = pants(repo, "store", "--remove=failed", "--yes").stdout
    assert f"Removed 2 of 2 artifacts from {store}." in failed, failed
    left = store_rows(pants(repo, "store").stdout)
    assert "checkpoints/broken@2026.12.01" not in left and "hf/broken@2026.12.01" not in left
    assert left["checkpoints/ci_tiny@2026.11.29"] == ("SUCCESS", "experiments:ci_tiny")


def unused_port() -> int:
    """A free port below Linux's ephemeral range (32768-60999), so that no connection opened
    while Pants builds can take it before the coordinator listens on it."""
    for port in random.sample(range(20000, 32000), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-32000")
