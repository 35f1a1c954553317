"""kiln.runner's decisions: serve, refuse drift, wait for or refuse a concurrent run, place
inputs atomically."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from kiln_testing.bucket_fixtures import gcs_server, s3_server
from kiln_testing.buckets import fresh_url
from kiln_testing.data import STDLIB_TOKENIZER
from kiln_testing.processes import bundle_pythonpath, python_env
from kiln_testing.training import (
    EVAL_TASK,
    EXAMPLE_SPEC,
    build_tiny_cache,
    read_jsonl,
    write_eval_task,
    write_runner_step,
)

from kiln import artifacts
from kiln.artifacts.atomic import atomic_write_json, atomic_write_text
from kiln.artifacts.folder import ArtifactFolder
from kiln.artifacts.lease import Lease, LeaseRecord
from kiln.artifacts.local import LocalStore
from kiln.artifacts.locations import open_store
from kiln.artifacts.store import ObjectStore
from kiln.runner.__main__ import main
from kiln.runner.bundle import write_bundle
from kiln.runner.checkpoint_step import (
    _restart_dev_run,
    check_write_paths,
    job_argv,
    run_step,
    train_spec,
)
from kiln.runner.command_line import apply_overrides, argument_parser, read_step
from kiln.runner.decision import same_artifact
from kiln.runner.errors import StepError
from kiln.runner.inputs import place_cache, place_inputs
from kiln.runner.leasing import HolderWatch, hold
from kiln.runner.replacing import begin
from kiln.runner.step_run import Destination
from kiln.runner.workspace import Workspace
from kiln_contract.record import ArtifactRecord, InputRef
from kiln_contract.step import StepSpec

__all__ = ["gcs_server", "s3_server"]  # fixtures

IDENTITY = {"kind": "lm_checkpoint", "batch_size": 8, "model": {"hidden_dim": 64}}


def record(fingerprint: str = "f" * 16, **identity: Any) -> ArtifactRecord:
    return ArtifactRecord(
        kind="lm_checkpoint",
        name="checkpoints/x",
        version="2026.11.29",
        fingerprint=fingerprint,
        identity={**IDENTITY, **identity},
    )


def step_json(code_digest: str = "a" * 64, **identity: Any) -> dict[str, Any]:
    """A step as the backend writes it (docs/step-spec.md): EXAMPLE_SPEC's config and runtime,
    its two caches carried under the inputs folder."""
    config = copy.deepcopy(EXAMPLE_SPEC["config"])
    caches = config["datasets"] + config["validation"]
    for cache in caches:
        del cache["path"]
    config["evals"] = {"tasks": [{"name": "copa"}], "every": 5, "task_paths": ["exp/tasks"]}
    rec = record(**identity)
    return {
        "step_version": 1,
        "kind": "lm_checkpoint",
        "name": rec.name,
        "version": rec.version,
        "fingerprint": rec.fingerprint,
        "record": rec.to_json(),
        "config": config,
        "runtime": EXAMPLE_SPEC["runtime"],
        "inputs": [
            {
                "ref": f"{c['name']}@{c['version']}",
                "name": c["name"],
                "version": c["version"],
                "record": {
                    **rec.to_json(),
                    "kind": "tokenized_cache",
                    "name": c["name"],
                    "fingerprint": c["fingerprint"],
                },
                "location": f"inputs/{c['name']}/{c['version']}",
            }
            for c in caches
        ],
        "provenance": {"code_digest": code_digest, "lockfile_digest": "l" * 64},
    }


def step(code_digest: str = "a" * 64, **identity: Any) -> StepSpec:
    return StepSpec.from_json(step_json(code_digest, **identity))


def built(directory: Path, rec: ArtifactRecord, code_digest: str = "a" * 64) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    atomic_write_json(
        directory / artifacts.RECORD_FILE,
        {**rec.to_json(), "provenance": {"code_digest": code_digest}},
    )
    atomic_write_text(directory / artifacts.SUMMARY_TEXT_FILE, "the summary\n")
    ArtifactFolder.at(directory).write_status(artifacts.SUCCESS)
    return directory


def folder_of(output: Path, prefix: Path | None = None) -> ArtifactFolder:
    """The artifact folder `output`, in the store at `prefix` (default: its parent)."""
    root = prefix or output.parent
    return ArtifactFolder(LocalStore(root), output.relative_to(root).as_posix())


def at(output: Path, prefix: Path | None = None) -> Destination:
    """The runner's target: `output` in the artifact store at `prefix`, or (None) a scratch
    folder (`--output`)."""
    return Destination(folder_of(output, prefix), artifact_store=prefix is not None)


def replaced_folder(output: Path) -> Path:
    return output.parent / f".{output.name}.replaced"


def test_a_built_artifact_is_served(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    output = built(tmp_path / "out", record())
    assert run_step(step(), tmp_path, at(output)) == 0
    printed = capsys.readouterr().out
    assert "is already built" in printed and "the summary" in printed
    assert "built by other code" not in printed


def test_a_code_only_change_is_reported_not_retrained(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    output = built(tmp_path / "out", record(), code_digest="b" * 64)
    assert run_step(step(code_digest="c" * 64), tmp_path, at(output)) == 0
    assert "built by other code (runtime digest bbbbbbbbbbbb, now cccccccccccc)" in (
        capsys.readouterr().out
    )


def test_a_reused_version_with_another_config_is_refused(tmp_path: Path) -> None:
    output = built(tmp_path / "out", record(fingerprint="0" * 16, batch_size=16))
    with pytest.raises(StepError) as error:
        run_step(step(), tmp_path, at(output))
    message = str(error.value)
    assert "differs in: batch_size" in message and "Bump `version`" in message
    assert ArtifactFolder.at(output).status() == artifacts.SUCCESS  # the old artifact is untouched


def test_a_second_concurrent_run_is_refused_with_no_wait_or_force(tmp_path: Path) -> None:
    output = tmp_path / "store/checkpoints/x/2026.11.29"
    with Lease.beside(output, what="train checkpoints/x@2026.11.29").acquire(wait=False):
        for how in ({"wait": False}, {"force": True}):
            with pytest.raises(StepError, match="A second run of checkpoints/x@2026.11.29 is"):
                run_step(step(), tmp_path, at(output, tmp_path / "store"), **how)
    assert ArtifactFolder.at(output).status() is None


def hold_then(output: Path, finish: Callable[[], object], seconds: float = 0.3) -> Lease:
    """The artifact's lease, held by another builder that calls `finish` and releases it after
    `seconds` (from a thread: this process is that builder's stand-in)."""
    holder = Lease.beside(output, what="train checkpoints/x@2026.11.29").acquire(wait=False)

    def end() -> None:
        finish()
        holder.release()

    threading.Timer(seconds, end).start()
    return holder


def test_a_second_run_waits_for_the_holder_then_serves_its_result(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    output = tmp_path / "out"
    hold_then(output, lambda: built(output, record()))
    assert run_step(step(), tmp_path, at(output)) == 0
    printed = capsys.readouterr().out
    assert "kiln: waiting for checkpoints/x@2026.11.29: train checkpoints/x@2026.11.29 (host " in (
        printed
    )
    assert "no step logged yet (--no-wait refuses instead of waiting)" in printed
    assert "is already built" in printed and "the summary" in printed
    assert not (tmp_path / ".out.lease").exists()  # the waiter released the lease


@pytest.fixture(params=["local", "s3", "gs"])
def any_store(request: pytest.FixtureRequest, tmp_path: Path) -> ObjectStore:
    """A directory, or a path of its own in an S3 or a GCS bucket on a server on loopback."""
    if request.param == "local":
        return LocalStore(tmp_path / "store")
    request.getfixturevalue({"s3": "s3_server", "gs": "gcs_server"}[request.param])
    return open_store(fresh_url(request.param))


def test_a_second_run_waits_for_the_holder_in_any_store_then_serves_its_result(
    any_store: ObjectStore, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = ArtifactFolder(any_store, "checkpoints/x/2026.11.29")
    holder = folder.lease("train checkpoints/x@2026.11.29").acquire(wait=False)

    def finish() -> None:
        rec = {**record().to_json(), "provenance": {"code_digest": "a" * 64}}
        folder.write_json(artifacts.RECORD_FILE, rec)
        any_store.write(folder.child(artifacts.SUMMARY_TEXT_FILE), b"the summary\n")
        folder.write_status(artifacts.SUCCESS)
        holder.release()

    threading.Timer(3.0, finish).start()  # while the run waits
    assert run_step(step(), tmp_path, Destination(folder)) == 0
    printed = capsys.readouterr().out
    assert "kiln: waiting for checkpoints/x@2026.11.29: train checkpoints/x@2026.11.29" in printed
    assert f"is already built at {folder.location()}" in printed and "the summary" in printed
    assert any_store.keys("checkpoints/x") == ["2026.11.29/STATUS", "2026.11.29/artifact.json",
                                               "2026.11.29/summary.txt"]  # fmt: skip


def test_a_waiter_reports_a_holder_that_failed(tmp_path: Path) -> None:
    output = tmp_path / "out"
    hold_then(output, lambda: ArtifactFolder.at(built(output, record())).mark_failed("it broke"))
    with pytest.raises(StepError, match=r"the run this one waited for, train .* failed .*: it broke\)"):
        run_step(step(), tmp_path, at(output))
    assert ArtifactFolder.at(output).status() == artifacts.FAILED  # left for the rerun to resume


def test_a_waiter_goes_on_with_a_build_its_holder_left_unfinished(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    output = tmp_path / "out"
    hold_then(output, lambda: ArtifactFolder.at(output).write_status(artifacts.RUNNING))
    with contextlib.ExitStack() as held:
        lease = hold(step(), folder_of(output), held, wait=True)
        assert lease is not None and (tmp_path / ".out.lease").exists()
    printed = capsys.readouterr().out
    assert "ended without finishing checkpoints/x@2026.11.29 (STATUS RUNNING): this run" in printed


def test_the_waiter_says_the_holders_step_and_eta_at_most_every_30_s(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    output = tmp_path / "out"
    output.mkdir()
    lines = [{"step": 4, "throughput/step_time": 2.0}, {"step": 4, "eval/loss": 3.0}, {"step": 5}]
    (output / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    watch = HolderWatch(step(), folder_of(output))
    holder = LeaseRecord("o", "gpu-7", 4242, None, "train checkpoints/x@2026.11.29", 0.0, 9e9)
    clock = iter([100.0, 110.0, 131.0])
    monkeypatch.setattr("kiln.runner.leasing.time.monotonic", lambda: next(clock))
    for _ in range(3):
        watch(holder)
    said = capsys.readouterr().out.splitlines()
    total = step().config.num_train_steps
    assert len(said) == 2 and said[0] == said[1]
    assert "(host gpu-7, pid 4242, since " in said[0]
    eta = 2 * (total - 4)
    assert f"step 4 of {total}, ETA {eta // 60}m{eta % 60:02d}s" in said[0]


def test_a_served_artifact_finishes_a_replacement_left_behind(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = tmp_path / "store"
    output = built(store / "checkpoints/x/2026.11.29", record())
    built(replaced_folder(output), record(fingerprint="0" * 16))
    export = ArtifactRecord(
        kind="hf_model", name="hf/x", version="2026.11.29", fingerprint="e" * 16, identity={},
        inputs=(InputRef("checkpoints/x@2026.11.29", "0" * 16),),
    )  # fmt: skip
    built(store / "hf/x/2026.11.29", export)
    assert run_step(step(), tmp_path, at(output, store)) == 0
    printed = capsys.readouterr().out
    assert "is already built" in printed and not replaced_folder(output).exists()
    assert f"deleted the replaced checkpoints/x@2026.11.29 ({replaced_folder(output)})" in printed
    assert "1 built artifact(s) in the store were built from the replaced" in printed
    assert f"hf/x@2026.11.29 (hf_model) at {store / 'hf/x/2026.11.29'}: delete " in printed


def test_a_run_goes_on_with_a_stopped_forced_rebuild(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    output = built(tmp_path / "checkpoints/x/2026.11.29", record())
    begin(step(), folder_of(output), force=True)
    aside = replaced_folder(output)
    assert f"kiln: --force: moved {output} aside to {aside}" in capsys.readouterr().out
    ArtifactFolder.at(output).write_status(artifacts.RUNNING)  # stopped mid-way (killed, --max-steps)
    begin(step(), folder_of(output), force=False)
    assert "going on with the forced rebuild of checkpoints/x@2026.11.29; the replaced " in (
        capsys.readouterr().out
    )
    assert ArtifactFolder.at(aside).is_built()  # kept until the rebuild succeeds


def test_force_needs_the_artifact_store(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    step_file = tmp_path / "step.json"
    step_file.write_text(json.dumps(step_json()))
    common = [str(step_file), "--inputs", str(tmp_path), "--force"]
    with pytest.raises(SystemExit):
        main([*common, "--output", str(tmp_path / "out")])
    assert "--force replaces an artifact in the store: give --prefix" in capsys.readouterr().err


def test_inputs_are_placed_once_and_checked(tmp_path: Path) -> None:
    cache = record(fingerprint="c" * 16)
    source = built(build_tiny_cache(tmp_path, "tokenized/x", 20, seed=0), cache)
    destination = tmp_path / "store/tokenized/x/2026.11.29"
    ledger = (source / "ledger.json").read_bytes()

    store = LocalStore(tmp_path / "store")
    assert place_cache(store, "tokenized/x/2026.11.29", source, cache) == str(destination)
    assert (destination / "ledger.json").read_bytes() == ledger
    assert not [p for p in destination.parent.iterdir() if p.name.startswith(".")]  # no temp left
    (source / "ledger.json").write_text("{}")
    place_cache(store, "tokenized/x/2026.11.29", source, cache)  # already there: kept
    assert (destination / "ledger.json").read_bytes() == ledger

    with pytest.raises(StepError, match="differs in"):
        place_cache(store, "tokenized/x/2026.11.29", source, record(fingerprint="d" * 16, batch_size=1))


def test_an_incomplete_input_is_refused(tmp_path: Path) -> None:
    source = tmp_path / "built"
    source.mkdir()
    with pytest.raises(StepError, match="not complete"):
        place_cache(LocalStore(tmp_path / "store"), "x", source, record())


def test_check_drift_without_a_record(tmp_path: Path) -> None:
    assert same_artifact(folder_of(tmp_path / "x"), record()) is None


def test_the_train_spec_gets_absolute_input_and_task_paths(tmp_path: Path) -> None:
    store = tmp_path / "store"
    workspace = Workspace(tmp_path / "out", None)
    spec = train_spec(step(), tmp_path, workspace, at(store / "checkpoints/x/v", store))
    assert spec.config.datasets[0].path == store / "tokenized/a/2026.11.29"
    assert spec.config.validation[0].path == store / "tokenized/val/2026.11.29"
    assert spec.config.evals is not None
    assert spec.config.evals.task_paths == (str(tmp_path / "exp/tasks"),)
    assert spec.output_path == tmp_path / "out"
    hermetic = train_spec(step(), tmp_path, workspace, at(tmp_path / "out"))
    assert hermetic.config.datasets[0].path == tmp_path / "inputs/tokenized/a/2026.11.29"


def test_run_time_overrides_leave_the_identity_alone() -> None:
    base = step()
    args = argument_parser().parse_args(
        ["step.json", "--inputs", ".", "--per-device-parallelism", "2", "--attention", "xla"]
        + ["--mesh", "data=2, fsdp=-1", "--max-eval-batches", "5", "--control-host", "0.0.0.0"]
    )
    overridden = apply_overrides(base, args)
    assert overridden.runtime.attention == "xla"
    assert overridden.runtime.control.host == "0.0.0.0"
    assert overridden.runtime.control.port == base.runtime.control.port
    assert overridden.runtime.max_eval_batches == 5
    assert overridden.runtime.per_device_parallelism == 2
    assert overridden.runtime.mesh == {"data": 2, "fsdp": -1, "tensor": 1}
    assert overridden.config == base.config
    with pytest.raises(SystemExit):
        argument_parser().parse_args(["s", "--inputs", ".", "--mesh", "fsdp"])
    with pytest.raises(StepError, match="--batch-size changes the artifact's identity"):
        apply_overrides(base, argument_parser().parse_args(["s", "--inputs", ".", "--batch-size", "4"]))
    scratch = ["s", "--inputs", ".", "--output", "out", "--batch-size", "4"]
    assert apply_overrides(base, argument_parser().parse_args(scratch)).config.batch_size == 4


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--validation-every", "0"], "runtime.validation_every: expected an integer >= 1, got 0"),
        (["--max-eval-batches", "0"], "runtime.max_eval_batches: expected an integer >= 1, got 0"),
        (["--mesh", "model=2"], "runtime.mesh: expected one of data, fsdp, tensor, got 'model'"),
    ],
)
def test_a_bad_override_names_the_field(flags: list[str], message: str) -> None:
    with pytest.raises(StepError, match=re.escape(message)):
        apply_overrides(step(), argument_parser().parse_args(["s", "--inputs", ".", *flags]))


def test_the_step_is_parsed_once_with_clear_errors(tmp_path: Path) -> None:
    path = tmp_path / "step.json"
    path.write_text(json.dumps(step_json()))
    assert read_step(path) == step()
    path.write_text(json.dumps({**step_json(), "step_version": 0}))
    with pytest.raises(StepError, match="step.json: step_version: expected 1, got 0; build the"):
        read_step(path)
    path.write_text(json.dumps({**step_json(), "runtime": {**EXAMPLE_SPEC["runtime"], "x": 1}}))
    with pytest.raises(StepError, match=re.escape("step.json: runtime: unknown field(s) x")):
        read_step(path)
    with pytest.raises(StepError, match="cannot read the step spec"):
        read_step(tmp_path / "missing.json")


# --- containment: nothing is written outside the prefix (or --output) ----------------------------


def outside_folder(tmp_path: Path) -> Path:
    """A folder outside the store holding a file that must survive every test."""
    outside = tmp_path / "outside"
    (outside / "checkpoints").mkdir(parents=True)
    (outside / "checkpoints/precious").write_text("keep me")
    return outside


def untouched(outside: Path) -> bool:
    files = sorted(str(p.relative_to(outside)) for p in outside.rglob("*"))
    return files == ["checkpoints", "checkpoints/precious"]


def test_a_symlink_out_of_the_store_stops_the_run_before_any_write(tmp_path: Path) -> None:
    outside, store = outside_folder(tmp_path), tmp_path / "store"
    store.mkdir()
    (store / "checkpoints").symlink_to(outside)  # {prefix}/checkpoints -> elsewhere
    output = store / "checkpoints/x/2026.11.29"
    with pytest.raises(StepError, match=f"resolves to {outside}/x/2026.11.29, outside {store}"):
        run_step(step(), tmp_path, at(output, store))
    assert untouched(outside)


def test_an_input_placed_through_a_symlink_out_of_the_store_is_refused(tmp_path: Path) -> None:
    outside, store = outside_folder(tmp_path), tmp_path / "store"
    store.mkdir()
    (store / "tokenized").symlink_to(outside)
    with pytest.raises(StepError, match="input cache tokenized/a@2026.11.29 at .* outside"):
        place_inputs(step(), tmp_path, LocalStore(store))
    assert untouched(outside)


def test_checkpoint_folders_must_stay_in_the_output(tmp_path: Path) -> None:
    outside, output = outside_folder(tmp_path), tmp_path / "out"
    output.mkdir()
    (output / "checkpoints").symlink_to(outside / "checkpoints")
    spec = train_spec(step(), tmp_path, Workspace(output, None), at(output))
    with pytest.raises(StepError, match="the checkpoint folder .* outside"):
        check_write_paths(spec, output)
    (output / "checkpoints").unlink()
    check_write_paths(spec, output)  # a plain folder is fine

    base = tmp_path / "temporaries"
    (base / "checkpoints/x").mkdir(parents=True)
    (base / "checkpoints/x/2026.11.29").symlink_to(outside)
    runtime = dataclasses.replace(
        spec.runtime,
        checkpointer=dataclasses.replace(spec.runtime.checkpointer, temporary_base_path=base),
    )
    with pytest.raises(StepError, match="the temporary checkpoints .* outside"):
        check_write_paths(dataclasses.replace(spec, runtime=runtime), output)
    assert untouched(outside)


def test_a_dev_rerun_deletes_only_its_own_checkpoints(tmp_path: Path) -> None:
    dev = StepSpec.from_json({**step_json(), "version": "dev", "record": {
        **record().to_json(), "version": "dev"}})  # fmt: skip
    output = built(tmp_path / "store/checkpoints/x/dev", dev.record)
    (output / "checkpoints/step-4").mkdir(parents=True)
    _restart_dev_run(dev, at(output, tmp_path / "store"))
    assert not (output / "checkpoints").exists()
    assert ArtifactFolder.at(output).is_built()  # the rest is the runner's to overwrite, in order

    outside = outside_folder(tmp_path)
    (output / "checkpoints").symlink_to(outside / "checkpoints")
    with pytest.raises(StepError, match="the checkpoint folder .* outside"):
        _restart_dev_run(dev, at(output, tmp_path / "store"))
    assert untouched(outside)

    stranger = built(tmp_path / "store/checkpoints/y/dev", record())  # names checkpoints/x@2026...
    (stranger / "checkpoints").mkdir()
    with pytest.raises(StepError, match="not this artifact's folder, so nothing in it is deleted"):
        _restart_dev_run(dev, at(stranger, tmp_path / "store"))
    assert (stranger / "checkpoints").is_dir()


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("name", "../../home/x", "name: must be `/`-separated parts"),
        ("version", "../../x-dev", "version: must be a calendar version"),
    ],
)
def test_a_hostile_step_is_refused_when_parsed(
    tmp_path: Path, field: str, value: str, message: str
) -> None:
    path = tmp_path / "step.json"
    path.write_text(json.dumps({**step_json(), field: value}))
    with pytest.raises(StepError, match=re.escape(message)):
        read_step(path)


def test_a_bundle_carries_what_the_run_reads_and_trains_and_evaluates_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--bundle DIR`, written from the repository root as `pants run` runs: the step, its inline
    caches, its eval task files, the local tokenizer folder its caches name relative to the root,
    and Kiln's sources, whole or absent. With the repository gone, the runner in the folder trains,
    evaluates (task and tokenizer from the folder) and samples. A cache in this machine's store
    folder cannot travel, and is named."""
    root = tmp_path / "repository"
    shutil.copytree(STDLIB_TOKENIZER["path"], root / "tokenizers/stdlib")
    write_eval_task(root / "tasks", data_from=root)
    monkeypatch.chdir(root)
    evals = {"tasks": [{"name": EVAL_TASK, "num_fewshot": 0}], "every": 4, "task_paths": ["tasks"]}
    step_file = write_runner_step(
        root, tokenizer={"kind": "local", "path": "tokenizers/stdlib"},
        **{"config.num_train_steps": 4, "config.evals": evals},
    )  # fmt: skip
    bundle = tmp_path / "bundle"
    command = write_bundle(step_file, read_step(step_file), root, bundle, "gs://b/kiln")
    assert command == (f"cd {bundle} && PYTHONPATH=src python -m kiln.runner step.json "
                       "--inputs . --prefix gs://b/kiln")  # fmt: skip
    assert (bundle / "step.json").read_bytes() == step_file.read_bytes()
    carried = ["tokenizers/stdlib/tokenizer.json", f"tasks/{EVAL_TASK}.yaml", "tasks/mc.jsonl",
               "src/kiln_contract/step.py", "tokenized_a/cache.json", "tokenized_val/cache.json"]
    assert [path for path in carried if not (bundle / path).is_file()] == []
    assert not list(bundle.rglob("__pycache__")) and not list(bundle.rglob("BUILD"))

    monkeypatch.chdir(tmp_path)
    shutil.rmtree(root)  # the other machine has the bundle alone
    built = tmp_path / "built"
    run = subprocess.run(
        [sys.executable, "-m", "kiln.runner", "step.json", "--inputs", ".", "--output", str(built)],
        cwd=bundle, env=python_env(JAX_PLATFORMS="cpu", PYTHONPATH=bundle_pythonpath()),
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    scores = [r for r in read_jsonl(built / "metrics.jsonl") if f"lm_eval/{EVAL_TASK}/acc" in r]
    assert [r["step"] for r in scores] == [4]
    summary = (built / artifacts.SUMMARY_TEXT_FILE).read_text()
    assert "Samples from step-4" in summary and "Samples: skipped" not in summary, summary

    spec = json.loads((bundle / "step.json").read_text())
    spec["inputs"][0] = {**spec["inputs"][0], "store_path": "/data/kiln/tokenized/a/v"}
    del spec["inputs"][0]["location"]
    ref = spec["inputs"][0]["ref"]
    with pytest.raises(StepError, match=f"--bundle: {ref} is a store cache in this machine's "
                       "folder /data/kiln/tokenized/a/v.*bucket prefix"):  # fmt: skip
        write_bundle(bundle / "step.json", StepSpec.from_json(spec), tmp_path, tmp_path / "b2",
                     "FOLDER")  # fmt: skip
    assert not (tmp_path / "b2").exists()


def test_a_cluster_hosts_recorded_command_names_no_node_path(tmp_path: Path) -> None:
    host = tmp_path / "kiln-host-abc"
    argv = ["/node/cache/bundles/d/kiln/runner/__main__.py", f"{host}/step.json", "--inputs",
            str(host), "--prefix", "s3://b/k", "--staging", f"{host}/staging", "--job", "j"]
    assert job_argv(argv, host) == ["-m", "kiln.runner", "{inputs}/step.json", "--inputs",
                                    "{inputs}", "--prefix", "s3://b/k", "--staging",
                                    "{inputs}/staging", "--job", "j"]  # fmt: skip
