"""`python -m kiln.runner` against damaged inputs, a full disk and other runs' leases: every
failure ends with one line, STATUS FAILED and a documented exit code, and the next run resumes.
A second run waits for the first and serves its result; `--force` replaces a built artifact.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import tensorstore as ts
from kiln_testing.housekeeping import remove
from kiln_testing.processes import python_env
from kiln_testing.read_only import READ_ONLY, read_only
from kiln_testing.small_disk import FULL_DISK, SmallDisk
from kiln_testing.training import write_runner_step

from kiln.artifacts.content import record_files
from kiln.artifacts.folder import ArtifactFolder
from kiln.artifacts.lease import LeaseRecord, lease_key
from kiln.artifacts.local import LocalStore
from kiln.artifacts.locations import open_store
from kiln.data.cache import zarr_spec
from kiln.data.verify import verify_once
from kiln.runner.command_line import read_step
from kiln.runner.inputs import place_inputs

REF = "checkpoints/tiny@2026.11.29"
STEPS = {"config.num_train_steps": 6, "runtime.checkpointer.every": 3}


@pytest.fixture(scope="module")
def step(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_runner_step(tmp_path_factory.mktemp("runner-faults"), **STEPS)


def runner(step: Path, prefix: Path) -> list[str]:
    return [sys.executable, "-m", "kiln.runner", str(step), "--inputs", str(step.parent),
            "--prefix", str(prefix)]  # fmt: skip


def environment() -> dict[str, str]:
    return python_env(JAX_PLATFORMS="cpu")


def run(command: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(command, env=environment(), capture_output=True, text=True, timeout=300)


def output(prefix: Path) -> Path:
    return prefix / "checkpoints/tiny/2026.11.29"


def placed(step: Path, prefix: Path) -> Path:
    """The training cache, placed in the store as a run places it; returns its shard folder."""
    place_inputs(read_step(step), step.parent, LocalStore(prefix))
    return prefix / "tokenized/a/2026.11.29/shards/shard-00000"


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("kiln: error:")]


def assert_failed_saying(prefix: Path, line: str) -> None:
    """STATUS FAILED, and beside it the line the run printed: a run whose terminal is gone
    still says why."""
    assert ArtifactFolder.at(output(prefix)).status() == "FAILED"
    assert (output(prefix) / "failure.txt").read_text() == line.removeprefix("kiln: error: ") + "\n"


def test_a_damaged_input_cache_ends_the_run_failed(step: Path, tmp_path: Path) -> None:
    prefix = tmp_path / "store"
    (placed(step, prefix) / "data/c/0").unlink()
    result = run(runner(step, prefix))
    assert result.returncode == 1, result.stderr
    [line] = error_lines(result.stderr)
    assert "input tokenized/a@2026.11.29: token cache tokenized/a@2026.11.29 at " in line
    assert "shard shard-00000, file data/c/0 is missing" in line
    assert "Traceback" not in result.stderr
    assert_failed_saying(prefix, line)


def test_altered_bytes_are_refused_when_the_cache_is_placed(tmp_path: Path) -> None:
    step = write_runner_step(tmp_path / "inputs", **STEPS)
    source = step.parent / json.loads(step.read_text())["inputs"][0]["location"]
    chunk = source / "shards/shard-00000/offsets/c/0"
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the digest can tell
    chunk.write_bytes(bytes(data))
    prefix = tmp_path / "store"
    result = run(runner(step, prefix))
    assert result.returncode == 1, result.stderr
    [line] = error_lines(result.stderr)
    assert "shard shard-00000, file offsets/c/0 does not match its sha256 digest" in line
    assert "Traceback" not in result.stderr
    assert not (prefix / "tokenized/a/2026.11.29").exists()  # nothing damaged was placed
    assert [p.name for p in (prefix / "tokenized/a").iterdir()] == []  # no temp copy, no lease
    assert_failed_saying(prefix, line)


def test_ids_beyond_the_vocabulary_end_the_run_failed(step: Path, tmp_path: Path) -> None:
    prefix = tmp_path / "store"
    shard = placed(step, prefix)
    data = ts.open(zarr_spec(shard / "data"), open=True).result()
    data[10].write(60000).result()
    ledger_path = shard.parents[1] / "ledger.json"
    # Records that agree with the bytes (a writer that wrote these ids): only reading every id
    # finds them. The cache was verified when placed; its changed files make the run check it
    # in full again before its first step.
    ledger = json.loads(ledger_path.read_text())
    for name, now in record_files(shard, ledger["shards"][0]["files"]).items():
        ledger["shards"][0]["files"][name].update(now)
    ledger_path.write_text(json.dumps(ledger))

    result = run(runner(step, prefix))
    assert result.returncode == 1, result.stderr
    [line] = error_lines(result.stderr)
    assert "shard shard-00000, file data/c/0 holds token id 60000 at position 10" in line
    assert "Traceback" not in result.stderr
    assert_failed_saying(prefix, line)
    assert not (output(prefix) / "metrics.jsonl").exists()  # found before step 1


def test_a_verified_cache_altered_with_its_times_put_back_is_refused(tmp_path: Path) -> None:
    """A same-size rewrite of a chunk of a cache marked verified, its modification time then set
    back (`touch -r`): the file's change time still differs, so the run checks the cache in
    full and stops before step 1."""
    step = write_runner_step(tmp_path / "inputs", **STEPS)
    prefix = tmp_path / "store"
    shard = placed(step, prefix)
    verify_once(open_store(shard.parents[1]))  # marked verified, as a run marks the caches it checked
    chunk = shard / "data/c/0"
    before = chunk.stat()
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0x01  # another token id, still within the vocabulary
    chunk.write_bytes(bytes(data))
    os.utime(chunk, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert (chunk.stat().st_ino, chunk.stat().st_size, chunk.stat().st_mtime_ns) == (
        before.st_ino, before.st_size, before.st_mtime_ns
    )
    result = run(runner(step, prefix))
    assert result.returncode == 1, result.stderr
    [line] = error_lines(result.stderr)
    assert "shard shard-00000, file data/c/0 does not match its sha256 digest" in line
    assert_failed_saying(prefix, line)
    assert not (output(prefix) / "metrics.jsonl").exists()  # found before step 1


def _flip_the_largest_state_file(checkpoint: Path) -> None:
    """64 bytes of the checkpoint's largest state file flipped, its size kept."""
    largest = max((p for p in (checkpoint / "state").rglob("*") if p.is_file()),
                  key=lambda p: p.stat().st_size)  # fmt: skip
    data = bytearray(largest.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 64] = bytes(b ^ 0xFF for b in data[middle : middle + 64])
    largest.write_bytes(bytes(data))


def test_a_damaged_checkpoint_never_displaces_the_last_good_one(tmp_path: Path) -> None:
    """Train to step 2, then to 6 (temporaries, two kept); damage step 6; resume twice, with a
    second damage between: each resume starts from the newest intact checkpoint, which rolling
    retention keeps, and the run ends SUCCESS."""
    step = write_runner_step(
        tmp_path / "inputs", **{"config.num_train_steps": 10, "runtime.checkpointer.every": None}
    )
    prefix = tmp_path / "store"
    checkpoints = output(prefix) / "checkpoints"

    def run_steps(*flags: str) -> subprocess.CompletedProcess:
        result = run([*runner(step, prefix), *flags])
        assert result.returncode in (0, 3), result.stderr[-3000:]  # 3: stopped by --max-steps
        return result

    run_steps("--max-steps", "2")
    run_steps("--max-steps", "4")
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-2", "step-6"]
    _flip_the_largest_state_file(checkpoints / "step-6")

    resumed = run_steps("--max-steps", "2")
    assert f"skipping checkpoint {checkpoints / 'step-6'}: state/" in resumed.stderr
    assert f"resumed from {checkpoints / 'step-2'}" in resumed.stdout + resumed.stderr
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-2", "step-4", "step-6.damaged"]
    _flip_the_largest_state_file(checkpoints / "step-4")

    finished = run_steps()
    assert finished.returncode == 0
    assert f"resumed from {checkpoints / 'step-2'}" in finished.stdout + finished.stderr
    assert ArtifactFolder.at(output(prefix)).status() == "SUCCESS"
    assert sorted(p.name for p in checkpoints.iterdir()) == [
        "step-10", "step-4.damaged", "step-6.damaged"
    ]


def test_a_run_refuses_a_live_lease_of_another_host_until_it_expires(
    step: Path, tmp_path: Path
) -> None:
    prefix = tmp_path / "store"
    now = time.time()
    key = lease_key("checkpoints/tiny/2026.11.29")
    holder = LeaseRecord("x", "other-host", 4242, None, f"train {REF}", now - 30, now + 600)
    LocalStore(prefix).create(key, holder.to_bytes())
    refused = run([*runner(step, prefix), "--no-wait"])
    assert refused.returncode == 1, refused.stderr
    [line] = error_lines(refused.stderr)
    assert f"{REF} is being built by another run: the lease " in line
    assert f"held by train {REF} (host other-host, pid 4242, since " in line
    assert not output(prefix).exists()  # nothing was changed
    # The holder stops renewing: its lease expires (written so, not waited for: a loaded
    # machine may start the runner later than any short expiry).
    expired = LeaseRecord("x", "other-host", 4242, None, f"train {REF}", now - 30, now - 1)
    LocalStore(prefix).write(key, expired.to_bytes())
    taken = run([*runner(step, prefix), "--max-steps", "1"])
    assert taken.returncode == 3, taken.stderr  # it took the expired lease and trained a step
    assert "it expired" in taken.stderr


def wait_for(condition: Callable[[], bool], what: str, seconds: float = 240) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.05)


@pytest.fixture
def started() -> Iterator[list[subprocess.Popen]]:
    """The runners a test starts; any still there at its end (it failed) are killed, stopped
    ones included."""
    runs: list[subprocess.Popen] = []
    yield runs
    for run in runs:
        if run.poll() is None:
            run.kill()
            run.wait()


def start(
    started: list[subprocess.Popen], step: Path, prefix: Path, log: Path, *flags: str
) -> subprocess.Popen:
    """A runner writing its stdout to `log` (read while it runs) and its stderr beside it."""
    with log.open("w") as out, log.with_suffix(".err").open("w") as err:
        run = subprocess.Popen(
            [*runner(step, prefix), *flags], env=environment(), stdout=out, stderr=err
        )
    started.append(run)
    return run


def stopped_at_first_checkpoint(run: subprocess.Popen, prefix: Path) -> None:
    """Holds `run` still (SIGSTOP) once it has saved step 3: a second run surely finds it
    building, with steps logged."""
    checkpoint = output(prefix) / "checkpoints/step-3/metadata.json"
    wait_for(lambda: checkpoint.exists() or run.poll() is not None, "step 3")
    run.send_signal(signal.SIGSTOP)
    assert checkpoint.exists(), "the run ended before its first checkpoint"


def waiting(
    started: list[subprocess.Popen], step: Path, prefix: Path, log: Path
) -> subprocess.Popen:
    """A second run, once it says that it waits for the first."""
    second = start(started, step, prefix, log)
    wait_for(lambda: "kiln: waiting for" in log.read_text(), "the second run to wait")
    return second


def finished(run: subprocess.Popen, log: Path) -> str:
    """The stdout of `run` (written to `log`), once it has ended with exit status 0."""
    assert run.wait(timeout=300) == 0, log.with_suffix(".err").read_text()[-3000:]
    return log.read_text()


def built_export(prefix: Path, checkpoint_record: str) -> Path:
    """An hf_model export in the store whose record names the checkpoint as its input."""
    export = prefix / "hf/tiny/2026.11.29"
    export.mkdir(parents=True)
    ref = {"ref": REF, "fingerprint": json.loads(checkpoint_record)["fingerprint"]}
    record = {"kind": "hf_model", "name": "hf/tiny", "version": "2026.11.29", "inputs": [ref]}
    (export / "artifact.json").write_text(json.dumps(record))
    (export / "STATUS").write_text("SUCCESS\n")
    return export


def test_a_waiting_run_takes_over_from_a_killed_holder_and_serves_a_forced_rebuild(
    step: Path, tmp_path: Path, started: list[subprocess.Popen]
) -> None:
    prefix = tmp_path / "store"
    first = start(started, step, prefix, tmp_path / "first.out")
    stopped_at_first_checkpoint(first, prefix)
    lease = json.loads((output(prefix).parent / ".2026.11.29.lease").read_text())
    assert (lease["host"], lease["pid"]) == (socket.gethostname(), first.pid)
    second = waiting(started, step, prefix, log := tmp_path / "second.out")
    first.kill()
    first.wait()
    # The waiter takes the killed holder's lease over at once and resumes its build.
    said = finished(second, log)
    holder = f"train {REF} (host {socket.gethostname()}, pid {first.pid}, since "
    assert f"kiln: waiting for {REF}: {holder}" in said
    assert re.search(r"holds its lease; step [1-6] of 6, ETA \d+m\d\ds", said), said
    taken_over = log.with_suffix(".err").read_text()
    assert f"its holder, pid {first.pid} on this host, has ended" in taken_over
    assert f"ended without finishing {REF} (STATUS RUNNING): this run goes on with it" in said
    assert ArtifactFolder.at(output(prefix)).status() == "SUCCESS"
    assert not (output(prefix).parent / ".2026.11.29.lease").exists()

    # A forced rebuild, of an artifact an export was built from, with a run waiting for it.
    old_record = (output(prefix) / "artifact.json").read_text()
    export = built_export(prefix, old_record)
    aside = output(prefix).parent / ".2026.11.29.replaced"
    forced = start(started, step, prefix, log := tmp_path / "forced.out", "--force")
    wait_for(lambda: aside.exists() or forced.poll() is not None, "the forced run to begin")
    stopped_at_first_checkpoint(forced, prefix)  # the rebuild's own step 3
    assert ArtifactFolder.at(aside).status() == "SUCCESS" and (aside / "artifact.json").read_text() == old_record
    assert ArtifactFolder.at(output(prefix)).status() == "RUNNING"  # the old artifact is whole beside it
    served = waiting(started, step, prefix, served_log := tmp_path / "served.out")
    forced.send_signal(signal.SIGCONT)
    said = finished(forced, log)
    assert f"kiln: --force: moved {output(prefix)} aside to {aside}" in said
    assert f"kiln: deleted the replaced {REF} ({aside})" in said
    assert f"  hf/tiny@2026.11.29 (hf_model) at {export}: delete {export} and build" in said
    assert f"kiln: {REF} is already built at {output(prefix)}" in finished(served, served_log)
    assert ArtifactFolder.at(output(prefix)).status() == "SUCCESS" and not aside.exists()
    assert (output(prefix) / "artifact.json").read_text() != old_record  # the rebuild's own


def test_housekeeping_keeps_a_running_trainings_inputs(
    step: Path, tmp_path: Path, started: list[subprocess.Popen]
) -> None:
    """Removals from another clone while a run trains keep every input cache it reads (placed
    by the run), naming the run; the run finishes, and then nothing holds them."""
    prefix = tmp_path / "store"
    run = start(started, step, prefix, log := tmp_path / "run.out")
    stopped_at_first_checkpoint(run, prefix)
    caches = sorted(str(p.parent.relative_to(prefix)) for p in prefix.glob("tokenized/*/*/STATUS"))
    assert len(caches) == 2, caches  # training and validation
    for cache in caches:
        outcome = remove(prefix, cache)
        assert not outcome.done and outcome.kept is not None, outcome
        assert f"train {REF} (host {socket.gethostname()}, pid {run.pid}" in outcome.kept
    run.send_signal(signal.SIGCONT)
    finished(run, log)
    assert ArtifactFolder.at(output(prefix)).status() == "SUCCESS"
    assert [remove(prefix, cache).done for cache in caches] == [True, True]


def test_a_closed_terminal_stops_the_run_and_a_closed_pipe_never_fails_it(
    tmp_path: Path, started: list[subprocess.Popen]
) -> None:
    """SIGHUP (a closed terminal) stops a run as an interruption: a checkpoint, STATUS RUNNING,
    the signal in failure.txt. The rerun's stdout is closed by its reader after one line (a
    killed `pants run` client): its output goes nowhere and it trains to SUCCESS."""
    step = write_runner_step(tmp_path / "long", **{**STEPS, "config.num_train_steps": 40})
    prefix = tmp_path / "store"
    hung_up = start(started, step, prefix, tmp_path / "first.out")
    stopped_at_first_checkpoint(hung_up, prefix)
    hung_up.send_signal(signal.SIGHUP)
    hung_up.send_signal(signal.SIGCONT)
    assert hung_up.wait(timeout=120) == 128 + signal.SIGHUP
    assert ArtifactFolder.at(output(prefix)).status() == "RUNNING"
    stopped = ArtifactFolder.at(output(prefix)).stop_reason() or ""
    assert stopped.startswith("interrupted by SIGHUP after step ") and "Rerun to resume" in stopped

    rerun = subprocess.Popen(runner(step, prefix), env=environment(), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)  # fmt: skip
    started.append(rerun)
    assert rerun.stdout is not None and rerun.stdout.readline()
    rerun.stdout.close()  # the reader is gone: every later write finds a broken pipe
    _, errors = rerun.communicate(timeout=300)
    assert rerun.returncode == 0, errors[-3000:]
    assert "Broken pipe" not in errors and "Traceback" not in errors
    assert ArtifactFolder.at(output(prefix)).status() == "SUCCESS"


def test_a_full_disk_ends_the_run_failed_and_it_resumes(step: Path, tmp_path: Path) -> None:
    # Room for the caches and one checkpoint (about 8.5 MB), not for the second.
    disk = SmallDisk(tmp_path / "disk", size=12 << 20, file_limit=3 << 20)
    try:
        prefix = disk.folder / "store"
        full = disk.run(runner(step, prefix), env={"JAX_PLATFORMS": "cpu"})
        assert full.returncode == 4, full.stderr[-3000:]
        [line] = error_lines(full.stderr)
        assert line.startswith(f"kiln: error: {disk.folder}/") and line.endswith(FULL_DISK), line
        assert "Traceback" not in full.stderr, full.stderr[-3000:]
        assert ArtifactFolder.at(output(prefix)).status() == "FAILED"
        disk.grow()
        resumed = disk.run(runner(step, prefix), env={"JAX_PLATFORMS": "cpu"})
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert ArtifactFolder.at(output(prefix)).status() == "SUCCESS"
        if disk.mounted:  # the first checkpoint fitted: the run went on from it
            assert "resumed from" in resumed.stderr + resumed.stdout
    finally:
        disk.close()


def test_a_read_only_store_fails_in_one_line(step: Path, tmp_path: Path) -> None:
    """`--prefix` a folder nothing may write (a read-only mount; without root, its mode): one
    line naming the store and what to do, before anything is trained."""
    with read_only(tmp_path / "store") as prefix:
        result = run(runner(step, prefix))
    assert result.returncode == 4, result.stderr[-3000:]
    [line] = error_lines(result.stderr)
    assert line.startswith(f"kiln: error: {prefix}: the artifact store cannot be written here (")
    assert any(cause in line for cause in READ_ONLY) and line.endswith("make this one writable")
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert list(prefix.iterdir()) == []
