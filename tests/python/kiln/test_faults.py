"""Fault injection with real processes: the process that started a runtime process is SIGKILLed
at a seeded random point, the runtime process stops within seconds, and a rerun ends exactly
where an uninterrupted run does.

The parent stands in for Pants (pantsd, or `pants --no-pantsd run`): it starts the runtime
process in a session of its own, as Pants does, so nothing but kiln.lifetime stops it when the
parent dies. `KILN_FAULT_SEED` picks other kill points (the seed is in each failure message).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from kiln_testing.data import make_spec as make_cache_spec
from kiln_testing.data import write_corpus
from kiln_testing.processes import python_env
from kiln_testing.training import build_tiny_cache, make_spec, read_jsonl

from kiln.data.cache import TokenCache
from kiln.data.tokenize import ORPHAN_GRACE_SECONDS as tokenize_grace
from kiln.lifetime import POLL_SECONDS
from kiln.train.__main__ import ORPHAN_GRACE_SECONDS as train_grace
from kiln.train.spec import parse_spec
from kiln.train.trainer import train
from kiln_contract.processes import is_running

SEED = int(os.environ.get("KILN_FAULT_SEED", "31"))
# Starts argv in a new session (like Pants), prints its pid, waits for it.
PARENT = (
    "import subprocess, sys\n"
    "child = subprocess.Popen(sys.argv[1:], start_new_session=True)\n"
    "print(child.pid, flush=True)\n"
    "child.wait()\n"
)


def environment() -> dict[str, str]:
    return python_env(JAX_PLATFORMS="cpu")


def start_under_parent(argv: list[str], log: Path) -> tuple[subprocess.Popen[str], int]:
    """(the parent, the runtime process's pid)."""
    with log.open("w") as err:
        parent = subprocess.Popen(
            [sys.executable, "-c", PARENT, *argv], stdout=subprocess.PIPE, stderr=err,
            env=environment(), text=True,
        )  # fmt: skip
    assert parent.stdout is not None
    return parent, int(parent.stdout.readline())


# kiln.lifetime's bound: a process whose parent dies is gone within POLL_SECONDS + its grace
# period, plus the time a loaded machine takes to run its watcher thread once: this margin.
LOADED_MACHINE_MARGIN_SECONDS = 5.0


def kill_parent(parent: subprocess.Popen[str], child: int, grace_seconds: float, log: Path) -> None:
    """SIGKILLs the parent; asserts the child is gone within lifetime's bound."""
    parent.send_signal(signal.SIGKILL)
    parent.wait(timeout=10)
    deadline = time.monotonic() + POLL_SECONDS + grace_seconds + LOADED_MACHINE_MARGIN_SECONDS
    while is_running(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not is_running(child), f"seed {SEED}: pid {child} survived its parent\n{log.read_text()}"


def tokenize(*argv: str) -> None:
    command = [sys.executable, "-m", "kiln.data.tokenize", *argv]
    done = subprocess.run(command, capture_output=True, text=True, env=environment())
    assert done.returncode == 0, done.stderr


def documents(cache: Path) -> list[list[int]]:
    opened = TokenCache.open(cache)
    return [opened.document(i).tolist() for i in range(opened.num_documents)]


def test_a_tokenizer_whose_parent_is_killed_stops_and_the_rebuild_is_exact(tmp_path: Path):
    write_corpus(tmp_path / "corpus")
    spec = make_cache_spec({"kind": "files", "paths": [str(tmp_path / "corpus/*.jsonl")]},
                           num_shards=2)  # fmt: skip
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps(spec))
    store = tmp_path / "store"
    shards = [str(store / f"tokenized/.test.shards/shard-{i}") for i in range(2)]
    root = ["--root", str(store)]

    # Killed at a seeded point of shard 0: while importing, tokenizing or writing.
    log = tmp_path / "shard.log"
    parent, child = start_under_parent(
        [sys.executable, "-m", "kiln.data.tokenize", "shard", str(spec_file), "--index", "0",
         "--out", shards[0], *root], log,
    )  # fmt: skip
    time.sleep(random.Random(SEED).uniform(0.3, 4.0))
    kill_parent(parent, child, tokenize_grace, log)

    for index, shard in enumerate(shards):
        tokenize("shard", str(spec_file), "--index", str(index), "--out", shard, *root)
    cache = store / "tokenized/test/2026.11.29"
    tokenize("merge", str(spec_file), "--shards", *shards, "--out", str(cache), *root)
    assert not (store / "tokenized/.test.shards").exists()  # no temporaries left behind

    reference = tmp_path / "reference"
    tokenize("build", str(spec_file), "--out", str(reference))
    assert documents(cache) == documents(reference)


# The parent dies within the first eighth of the run: the orphaned trainer notices within
# lifetime.POLL_SECONDS (0.5 s: about 10 of these tiny steps, 25-40 ms each on 2 cores), and at
# least 84 steps are left to run when its SIGTERM comes (a run that had already finished would
# exit without a stop message).
NUM_STEPS = 96


def final_state(output: Path) -> list[np.ndarray]:
    state = ocp.StandardCheckpointer().restore(output / f"checkpoints/step-{NUM_STEPS}/state")
    return [np.asarray(leaf) for leaf in jax.tree.leaves(state)]


def losses(output: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["train/loss"]) for r in read_jsonl(output / "metrics.jsonl")
            if "train/loss" in r]  # fmt: skip


def wait_for_step(output: Path, step: int, parent: subprocess.Popen[str], log: Path) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if (output / "metrics.jsonl").exists() and any(s >= step for s, _ in losses(output)):
            return
        assert parent.poll() is None, f"the run ended before step {step}\n{log.read_text()}"
        time.sleep(0.05)
    raise AssertionError(f"no step {step} within 300 s\n{log.read_text()}")


@pytest.mark.skipif(
    jax.device_count() != 1, reason="the reference run must use the subprocess's 1 device"
)
def test_a_trainer_whose_parent_is_killed_saves_stops_and_resumes_exactly(tmp_path: Path):
    caches = {"tokenized/a": build_tiny_cache(tmp_path, "tokenized/a", 120, seed=0)}
    overrides = {"config.num_train_steps": NUM_STEPS, "runtime.validation_every": NUM_STEPS}
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    train(parse_spec(make_spec(reference, caches, {}, **overrides)))

    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps(make_spec(resumed, caches, {}, **overrides)))
    kill_at = random.Random(SEED).randint(2, NUM_STEPS // 8)
    log = tmp_path / "train.log"
    parent, child = start_under_parent([sys.executable, "-m", "kiln.train", str(spec_file)], log)
    wait_for_step(resumed, kill_at, parent, log)
    kill_parent(parent, child, train_grace, log)
    assert "interrupted by SIGTERM" in log.read_text()  # it saved a checkpoint, then exited

    finished = subprocess.run([sys.executable, "-m", "kiln.train", str(spec_file)],
                              capture_output=True, text=True, env=environment())  # fmt: skip
    assert finished.returncode == 0, finished.stderr
    summary = json.loads(finished.stdout[finished.stdout.index("\n{") :])
    assert summary["steps_this_run"] <= NUM_STEPS - kill_at  # it resumed where it stopped
    assert losses(resumed) == losses(reference)
    for got, expected in zip(final_state(resumed), final_state(reference)):
        np.testing.assert_array_equal(got, expected)


# Busy in Python, and on SIGTERM stuck in a C call that holds the GIL for hours (a save hung in
# native code, say): no Python thread of it runs again, and only the kernel's kill after the
# grace period stops it. It says when it watches, so that its parent dies after that, not in
# the ~0.1 s before.
CLINGING = (
    "import signal, sys\n"
    "from kiln import lifetime\n"
    "signal.signal(signal.SIGTERM, lambda *_: sum(range(10**12)))\n"
    "lifetime.stop_when_orphaned(float(sys.argv[1]))\n"
    "print('watching', flush=True)\n"
    "while True:\n"
    "    pass\n"
)


def test_an_orphan_stuck_after_sigterm_is_gone_within_the_bound_on_a_loaded_machine(
    tmp_path: Path,
) -> None:
    """Two busy loops per core compete with it (and its busy main thread with the watcher for
    the GIL): the watcher still notices, and the kernel ends the process at the grace period."""
    cores = len(os.sched_getaffinity(0))
    burners = [subprocess.Popen(["/bin/sh", "-c", "while :; do :; done"]) for _ in range(2 * cores)]
    log = tmp_path / "clinging.log"
    grace = 1.0
    try:
        parent, child = start_under_parent([sys.executable, "-c", CLINGING, str(grace)], log)
        try:
            assert parent.stdout is not None
            assert parent.stdout.readline() == "watching\n", log.read_text()
            kill_parent(parent, child, grace, log)
            assert "ended in 1 s if still running" in log.read_text()
        finally:
            if is_running(child):
                os.kill(child, signal.SIGKILL)
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
