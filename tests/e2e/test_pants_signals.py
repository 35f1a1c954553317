"""End to end: a `pants run` stopped by a signal leaves no process behind and resumes.

Real ./pants on a copy of this workspace trains a checkpoint that never finishes by itself, and
the test stops it the ways schedulers and people do: SIGTERM to `pants --no-pantsd run` (what
`timeout`, SLURM and Kubernetes send; kiln_pants.signals turns it into Ctrl-C), SIGKILL of it
(kiln.lifetime: the orphaned runner stops itself), and SIGKILL of the client of a pantsd run
(pantsd cancels the session). Each time every process the run started ends, a checkpoint of the
step reached is saved, STATUS never says SUCCESS, and the next run resumes from that checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.e2e.workspace import pantsd_pids

ENDLESS = """
lm_checkpoint(
    name="endless",
    artifact_name="checkpoints/endless",
    version="2026.12.01",
    model=llama(max_seq_len=64, hidden_dim=32, intermediate_dim=64, num_heads=2,
                num_kv_heads=1, num_layers=1),
    optimizer=adam(learning_rate=1e-2, warmup=2),
    datasets={"//experiments:stdlib_validation": 1.0},
    validation=["//experiments:stdlib_validation"],
    batch_size=4,
    seq_len=64,
    num_train_steps=1000000,
    z_loss_weight=None,
    evals=eval_suite([eval_task("kiln_stdlib_mc")], every=1000000,
                     task_files="//experiments/eval_tasks:stdlib"),
    resources=cpu(),
    compute_dtype="float32",
    checkpoint_interval_minutes=0.001,  # a temporary save after nearly every step
)
"""
TARGET = "experiments/signals_check:endless"
ARTIFACT = "artifacts/checkpoints/endless/2026.12.01"


@pytest.fixture(scope="module")
def repo(workspace: Path) -> Path:
    (workspace / "experiments/signals_check").mkdir()
    (workspace / "experiments/signals_check/BUILD").write_text(ENDLESS)
    return workspace


def test_sigterm_without_pantsd_during_a_save_stops_the_run_cleanly(repo: Path) -> None:
    """SIGTERM while a periodic save is being written: the run ends in seconds with 143, its
    checkpoints complete or absent (never a half-written step folder), the reason naming
    SIGTERM beside STATUS, and the control endpoint's files gone."""
    with pants_run(repo, "--no-pantsd") as run:
        step = wait_for_training(repo, run, beyond=0)
        started = run_processes(run.pid)
        wait_for_a_save_in_progress(repo, run)
        signalled = time.monotonic()
        run.send_signal(signal.SIGTERM)
        output = finish(run)
        seconds = time.monotonic() - signalled
    assert run.returncode == 143, output  # 128 + SIGTERM, as a shell reports it
    # The run stops itself, in seconds (3-5 s idle, up to 11.5 s beside the cluster's tests on two
    # cores), long before Pants would kill it (process_execution_graceful_shutdown_timeout, 120 s).
    assert seconds <= 30, f"{seconds:.1f} s from SIGTERM to exit"
    assert "kiln: stopped by SIGTERM" in output
    # A run's console holds Kiln's lines: no library's progress bar (its eval task loads here).
    assert "Generating test split" not in output and "examples/s]" not in output, output
    assert_all_ended(started)
    assert_stopped_with_checkpoint_at_or_after(repo, step)
    assert_stop_recorded(repo, "interrupted by SIGTERM after step ", output)
    checkpoints = repo / ARTIFACT / "checkpoints"
    assert not [p.name for p in checkpoints.iterdir() if not (p / "metadata.json").is_file()]
    assert not (repo / ARTIFACT / "control").exists()


def test_sigkill_without_pantsd_leaves_no_process_and_resumes(repo: Path) -> None:
    saved = newest_checkpoint(repo)
    with pants_run(repo, "--no-pantsd") as run:
        step = wait_for_training(repo, run, beyond=saved)
        started = run_processes(run.pid)
        run.kill()
        output = finish(run)
    assert_all_ended(started)
    assert re.search(rf"resumed from \S*/checkpoints/step-{saved}\b", output), output
    assert_stopped_with_checkpoint_at_or_after(repo, step)
    assert_stop_recorded(repo, "interrupted by SIGTERM after step ", output)  # kiln.lifetime's


def test_sigkill_of_the_pantsd_client_stops_the_run(repo: Path) -> None:
    saved = newest_checkpoint(repo)
    with pants_run(repo, "--pantsd") as run:
        step = wait_for_training(repo, run, beyond=saved)
        (daemon,) = pantsd_pids(repo)
        started = {p for p in run_processes(daemon) if _is_runner(p)}
        assert started, "no runtime process found under pantsd"
        run.kill()
        finish(run)
    assert_all_ended(started)
    assert_stopped_with_checkpoint_at_or_after(repo, step)
    assert_stop_recorded(repo, "interrupted by SIG", "")  # its output went to the dead client


# --- running and watching `pants run` ---------------------------------------------------------


@contextmanager
def pants_run(repo: Path, *options: str) -> Iterator[subprocess.Popen[str]]:
    run = subprocess.Popen(
        ["./pants", *options, "run", TARGET],
        cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,  # a signal to the test's group does not reach it
    )  # fmt: skip
    try:
        yield run
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()


def finish(run: subprocess.Popen[str]) -> str:
    output, _ = run.communicate(timeout=180)
    return output


def wait_for_training(repo: Path, run: subprocess.Popen[str], *, beyond: int) -> int:
    """The newest step in metrics.jsonl once training is a few steps past `beyond`."""
    metrics = repo / ARTIFACT / "metrics.jsonl"
    deadline = time.monotonic() + 900  # a cold Pants cache builds the runtime first
    while time.monotonic() < deadline:
        assert run.poll() is None, finish(run)
        steps = [json.loads(line)["step"] for line in _lines(metrics)]
        if steps and max(steps) >= beyond + 3:
            return max(steps)
        time.sleep(0.5)
    pytest.fail(f"training of {TARGET} did not pass step {beyond + 3}")


def wait_for_a_save_in_progress(repo: Path, run: subprocess.Popen[str]) -> None:
    """Until a checkpoint's staging folder exists (kiln.train.checkpoints: `.step-N.saving`)."""
    checkpoints = repo / ARTIFACT / "checkpoints"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert run.poll() is None, finish(run)
        if any(checkpoints.glob(".step-*.saving")):
            return
        time.sleep(0.005)
    pytest.fail("no checkpoint save was seen in progress")


def _lines(path: Path) -> list[str]:
    try:
        return [line for line in path.read_text().splitlines() if line.endswith("}")]
    except FileNotFoundError:
        return []


Process = tuple[int, str, bytes]  # pid, start time (tells a reused pid apart), command line


def run_processes(root: int) -> set[Process]:
    """Every live descendant of `root`, found through /proc's parent links."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        fields = _stat_fields(stat)
        if fields:
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found: set[Process] = set()
    pending = list(children.get(root, []))
    while pending:
        pid = pending.pop()
        pending.extend(children.get(pid, []))
        process = _process(pid)
        if process:
            found.add(process)
    return found


def _stat_fields(stat: Path) -> list[str] | None:
    """state, ppid, ... starttime of /proc/PID/stat (after the command name), or None."""
    try:
        text = stat.read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()


def _process(pid: int) -> Process | None:
    fields = _stat_fields(Path(f"/proc/{pid}/stat"))
    if not fields or fields[0] in ("Z", "X"):  # ended (a zombie waits only for its reaper)
        return None
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return pid, fields[19], cmdline


def assert_all_ended(started: set[Process]) -> None:
    """Within the trainer's grace period (a checkpoint save, then SIGKILL at 30 s)."""
    assert any(map(_is_runner, started)), started
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        alive = {p for p in started if (q := _process(p[0])) and q[1] == p[1]}
        if not alive:
            return
        time.sleep(0.5)
    pytest.fail(f"still running after the run was stopped: {alive}")


def _is_runner(process: Process) -> bool:
    """The runner's command line: its PEX, the step spec and `--inputs SANDBOX`."""
    return b"\x00--inputs\x00" in process[2]


def newest_checkpoint(repo: Path) -> int:
    """The newest complete checkpoint's step (0: none)."""
    folders = (repo / ARTIFACT / "checkpoints").glob("step-*/metadata.json")
    steps = [int(m.group(1)) for p in folders if (m := re.fullmatch(r"step-(\d+)", p.parent.name))]
    return max(steps, default=0)


def assert_stopped_with_checkpoint_at_or_after(repo: Path, step: int) -> None:
    assert newest_checkpoint(repo) >= step
    status = repo / ARTIFACT / "STATUS"
    assert not status.exists() or status.read_text().strip() != "SUCCESS"


def assert_stop_recorded(repo: Path, reason: str, output: str) -> None:
    """The run's reason for stopping is beside its STATUS, where `plan` reads it, whether or not
    a terminal saw it."""
    recorded = repo / ARTIFACT / "failure.txt"
    assert recorded.is_file(), output
    assert reason in recorded.read_text(), output
