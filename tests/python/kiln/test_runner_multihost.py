"""`python -m kiln.runner` as a multi-host run on one machine: two runner processes (the same
command on every "host", two CPU devices each) build one checkpoint artifact; the second "host"
runs from a bundle (`--bundle`), as a machine without Pants or Kiln's checkout does.

Process 0 alone holds the lease and writes the record and STATUS; both train and compute the
end-of-run report (restore and sampling are collectives); a second run serves the built artifact
on every process without joining; when process 0 cannot start, no process trains.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from kiln_testing.multihost import multihost_flags, run_each
from kiln_testing.processes import bundle_pythonpath
from kiln_testing.steps import NUM_STEPS, write_step
from kiln_testing.training import read_jsonl

from kiln import artifacts
from kiln.artifacts.lease import Lease
from kiln.runner.__main__ import main
from kiln.runner.bundle import write_bundle
from kiln.runner.command_line import read_step
from kiln.runner.errors import StepError


def run_runners(
    step: Path, output: Path, bundle: Path | None = None
) -> list[subprocess.CompletedProcess]:
    command = [sys.executable, "-m", "kiln.runner", str(step), "--inputs", str(step.parent)]
    command += ["--output", str(output)]
    flags = multihost_flags(2)
    commands = [command + flags[0], command + flags[1]]
    if bundle is not None:  # host 1: the command --bundle prints, in the bundle's folder
        commands[1] = ["sh", "-c", f"cd {bundle} && PYTHONPATH={bundle_pythonpath()} exec "
                       f"{sys.executable} -m kiln.runner step.json --inputs . --output {output} "
                       + " ".join(flags[1])]  # fmt: skip
    return run_each(commands, devices=2)


@pytest.fixture(scope="module")
def step_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_step(tmp_path_factory.mktemp("runner-multihost"))


def test_two_runner_processes_build_one_artifact(step_path: Path) -> None:
    output = step_path.parent / "built"
    bundle = step_path.parent.parent / "bundle"
    argv = [str(step_path), "--inputs", str(step_path.parent), "--bundle", str(bundle)]
    assert main(argv) == 0
    assert (bundle / "step.json").read_bytes() == step_path.read_bytes()
    assert (bundle / "src/kiln/runner/__main__.py").is_file()
    with pytest.raises(StepError, match="the folder is not empty; give a new one"):
        write_bundle(step_path, read_step(step_path), step_path.parent, bundle, "FOLDER")
    results = run_runners(step_path, output, bundle=bundle)
    assert [r.returncode for r in results] == [0, 0], [r.stderr[-3000:] for r in results]
    assert (output / artifacts.STATUS_FILE).read_text().strip() == artifacts.SUCCESS
    assert "kiln: built checkpoints/tiny@" in results[0].stdout
    assert "kiln: built" not in results[1].stdout  # process 0 reports
    losses = [r["step"] for r in read_jsonl(output / "metrics.jsonl") if "train/loss" in r]
    assert losses == list(range(1, NUM_STEPS + 1))  # one writer
    summary = (output / artifacts.SUMMARY_TEXT_FILE).read_text()
    assert f"Samples from step-{NUM_STEPS}" in summary, summary  # sampled across both processes
    record = json.loads((output / artifacts.RECORD_FILE).read_text())
    argv = record["provenance"]["argv"]
    assert argv[argv.index("--process-id") + 1] == "0"  # process 0 wrote it

    served = run_runners(step_path, output)
    assert [r.returncode for r in served] == [0, 0], [r.stderr[-3000:] for r in served]
    assert all("is already built" in r.stdout and summary in r.stdout for r in served)


def test_no_process_trains_when_process_0_cannot_start(step_path: Path) -> None:
    output = step_path.parent / "leased"
    output.mkdir()
    with Lease.beside(output, what="train checkpoints/tiny").acquire(wait=False):  # another run
        results = run_runners(step_path, output)
    assert [r.returncode for r in results] == [1, 1], [r.stderr[-3000:] for r in results]
    assert "A second run of checkpoints/tiny@2026.11.29 is refused" in results[0].stderr
    assert "process 0 could not start checkpoints/tiny@2026.11.29" in results[1].stderr
    assert not (output / artifacts.STATUS_FILE).exists()
    assert not (output / "checkpoints").exists()


def test_auto_without_a_cluster_is_a_clear_error(step_path: Path) -> None:
    output = step_path.parent / "no-cluster"
    command = [sys.executable, "-m", "kiln.runner", str(step_path), "--inputs", str(step_path.parent)]
    [result] = run_each([[*command, "--output", str(output), "--coordinator", "auto"]], devices=1)
    assert result.returncode == 1, result.stderr[-2000:]
    assert "kiln: error: cannot join the multi-host run" in result.stderr
    assert "Traceback" not in result.stderr
    assert not output.exists()  # nothing started
