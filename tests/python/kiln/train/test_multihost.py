"""A multi-host run on one machine: two `python -m kiln.train` processes joined by jax.distributed
(gloo between them), two CPU devices each, against one process with four devices.

Same spec, same data=2 x fsdp=2 mesh: the two runs do the same arithmetic, so their losses,
validation and lm-eval scores agree. The two-process run also stops early (runtime.max_steps_this_run)
and resumes, which exercises the agreed save decision and a restore across processes; only
process 0 writes the run's files.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from kiln_testing.multihost import free_port, multihost_flags, run_each
from kiln_testing.training import (
    EVAL_TASK,
    build_tiny_cache,
    make_spec,
    read_jsonl,
    write_eval_task,
)

NUM_STEPS = 8
STOP_AFTER = 5  # the first two-process run stops here (a temporary checkpoint) and resumes


# Each process places the rows its devices hold of the same global batch (kiln.train.step).
SHARD_BATCH_SCRIPT = """
import sys
import jax, numpy as np
from jax.experimental import multihost_utils
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(sys.argv[1], 2, int(sys.argv[2]))
from kiln.train.mesh import make_mesh
from kiln.train.step import shard_batch
tokens = np.arange(4 * 8, dtype=np.int32).reshape(4, 8)
batch = {"tokens": tokens, "segment_ids": tokens * 0, "loss_mask": tokens * 0 + 1}
placed = shard_batch(batch, make_mesh({"data": 2, "fsdp": 2}))["tokens"]
assert placed.shape == (4, 8), placed.shape
assert len(placed.addressable_shards) == 2
np.testing.assert_array_equal(multihost_utils.process_allgather(placed, tiled=True), tokens)
jax.distributed.shutdown()
"""

# Process 0 meets an error alone, while process 1 waits in a collective it never completes.
LONE_ERROR_SCRIPT = """
import sys
from jax.experimental import multihost_utils
from kiln.train import multihost
group = multihost.ProcessGroup(sys.argv[1], 2, int(sys.argv[2]))
with multihost.exiting():
    with multihost.joined(group) as index:
        multihost_utils.sync_global_devices("joined")
        if index == 0:
            raise RuntimeError("an error only process 0 met")
        multihost_utils.sync_global_devices("never completed")
"""


# Two processes save one sharded array, each into a folder of its own (kiln.train.orbax_saves),
# process 0 slow to create its folder: it must not write before it has.
SLOW_FOLDER_SAVE_SCRIPT = """
import sys, time
import jax, numpy as np
from pathlib import Path
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(sys.argv[1], 2, int(sys.argv[2]))
from jax.sharding import NamedSharding, PartitionSpec
from orbax.checkpoint._src.path import atomicity
from kiln.train.mesh import make_mesh
from kiln.train.orbax_saves import orbax_checkpointer
create = atomicity._create_tmp_directory
async def slow_on_process_0(*args, **kwargs):
    if jax.process_index() == 0:
        time.sleep(3)
    return await create(*args, **kwargs)
atomicity._create_tmp_directory = slow_on_process_0
mesh = make_mesh({"data": 2, "fsdp": 1})
values = np.arange(16, dtype=np.float32).reshape(4, 4)
sharding = NamedSharding(mesh, PartitionSpec("data"))
array = jax.make_array_from_callback(values.shape, sharding, lambda index: values[index])
checkpointer = orbax_checkpointer(per_host_folders=True)
checkpointer.save(Path(sys.argv[3]) / f"host-{jax.process_index()}" / "state", {"w": array})
checkpointer.wait_until_finished()
print("saved")
jax.distributed.shutdown()
"""


def test_a_host_slow_to_create_its_save_folder_keeps_what_it_saved(tmp_path: Path) -> None:
    """Each host's folder is created before any host writes. With orbax's asynchronous creation,
    a host whose creation lagged wrote on another host's "created" signal, then either failed
    (EEXIST: seen in the cluster test's retried runs) or removed what it had written as an
    unfinished folder, leaving a checkpoint without its shards."""
    coordinator = f"127.0.0.1:{free_port()}"
    commands = [[sys.executable, "-c", SLOW_FOLDER_SAVE_SCRIPT, coordinator, str(i), str(tmp_path)]
                for i in (0, 1)]  # fmt: skip
    for result in run_each(commands, devices=1):
        assert result.returncode == 0 and "saved" in result.stdout, result.stderr[-3000:]
    # Each host's rows of "w" (zarr chunk "row.column"), and process 0's metadata.
    for host, written in ((0, ["_METADATA", "w/.zarray", "w/0.0"]), (1, ["w/1.0"])):
        state = tmp_path / f"host-{host}" / "state"
        missing = [name for name in written if not (state / name).is_file()]
        assert not missing, (host, missing, sorted(str(p) for p in state.rglob("*")))


def run_processes(spec_path: Path, num_processes: int) -> list[subprocess.CompletedProcess]:
    command = [sys.executable, "-m", "kiln.train", str(spec_path), "--quiet"]
    if num_processes == 1:
        return run_each([command], devices=4)
    return run_each(
        [command + flags for flags in multihost_flags(num_processes)],
        devices=4 // num_processes,
    )


def test_each_process_places_its_rows_of_one_global_batch() -> None:
    coordinator = f"127.0.0.1:{free_port()}"
    commands = [[sys.executable, "-c", SHARD_BATCH_SCRIPT, coordinator, str(i)] for i in (0, 1)]
    results = run_each(commands, devices=2)
    assert [r.returncode for r in results] == [0, 0], [r.stderr[-3000:] for r in results]


def test_a_process_that_fails_alone_says_why_and_the_run_ends_in_seconds() -> None:
    """Not after jax's shutdown barrier gives up (300 s), and not aborted before its error is
    printed (kiln.train.multihost)."""
    coordinator = f"127.0.0.1:{free_port()}"
    commands = [[sys.executable, "-c", LONE_ERROR_SCRIPT, coordinator, str(i)] for i in (0, 1)]
    began = time.monotonic()
    failed, waiting = run_each(commands, devices=1)
    assert time.monotonic() - began < 150, "the processes waited for the shutdown barrier"
    assert failed.returncode == 1, failed.stderr[-3000:]
    assert "RuntimeError: an error only process 0 met" in failed.stderr, failed.stderr[-3000:]
    assert waiting.returncode != 0  # ended by its coordination client, process 0 gone


@pytest.fixture(scope="module")
def spec_paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("multihost")
    train = build_tiny_cache(root / "caches", "tokenized/a", 150, seed=0)
    validation = build_tiny_cache(root / "caches", "tokenized/val", 30, seed=2)
    evals = {"tasks": [{"name": EVAL_TASK, "num_fewshot": 0, "alias": "mc"}], "every": NUM_STEPS,
             "task_paths": [str(write_eval_task(root / "tasks"))]}  # fmt: skip
    paths = {}
    for name in ("one-process", "two-processes"):
        spec = make_spec(
            root / name, {"tokenized/a": train}, {"tokenized/val": validation},
            **{"config.num_train_steps": NUM_STEPS, "config.evals": evals,
               "runtime.mesh": {"data": 2, "fsdp": 2, "tensor": 1},
               "runtime.validation_every": 4, "runtime.checkpointer.every": 4},
        )  # fmt: skip
        paths[name] = root / f"{name}.json"
        paths[name].write_text(json.dumps(spec))
    return paths


def test_two_processes_train_like_one_and_resume(spec_paths: dict[str, Path]) -> None:
    [single] = run_processes(spec_paths["one-process"], 1)
    assert single.returncode == 0, single.stderr[-3000:]

    spec = json.loads(spec_paths["two-processes"].read_text())
    spec["runtime"]["max_steps_this_run"] = STOP_AFTER
    stopping = spec_paths["two-processes"].with_name("stopping.json")
    stopping.write_text(json.dumps(spec))
    first = run_processes(stopping, 2)
    assert [r.returncode for r in first] == [3, 3], [r.stderr[-3000:] for r in first]
    second = run_processes(spec_paths["two-processes"], 2)
    assert [r.returncode for r in second] == [0, 0], [r.stderr[-3000:] for r in second]
    assert "resumed from" in second[0].stdout  # the losses below show that each one restored
    assert "resumed from" not in second[1].stdout  # one progress stream: process 0's

    one, two = (Path(json.loads(p.read_text())["output_path"]) for p in spec_paths.values())
    records = {run: read_jsonl(run / "metrics.jsonl") for run in (one, two)}
    train_losses = {
        run: [(r["step"], r["train/loss"]) for r in lines if "train/loss" in r]
        for run, lines in records.items()
    }
    # One line per step: process 1 wrote nothing, and the resumed run continued from step 5.
    assert [step for step, _ in train_losses[two]] == list(range(1, NUM_STEPS + 1))
    np.testing.assert_allclose(
        [loss for _, loss in train_losses[two]], [loss for _, loss in train_losses[one]], rtol=1e-5
    )
    final = {run: json.loads((run / "summary.json").read_text()) for run in (one, two)}
    for key in ("eval/macro_loss", "lm_eval/mc/acc"):
        assert final[two][key] == pytest.approx(final[one][key], rel=1e-5), key
    assert final[two]["checkpoint"].endswith(f"checkpoints/step-{NUM_STEPS}")
    assert json.loads((two / "config.json").read_text())["process_count"] == 2


def test_auto_without_a_cluster_is_a_clear_error() -> None:
    result = run_each([[sys.executable, "-m", "kiln.train", "spec.json", "--coordinator", "auto"]], 1)
    assert result[0].returncode == 1, result[0].stderr[-2000:]
    assert "cannot join the multi-host run (coordinator_address" in result[0].stderr
    assert "Traceback" not in result[0].stderr


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--coordinator", "127.0.0.1:1"], "needs --num-processes and --process-id"),
        (["--num-processes", "2", "--process-id", "0"], "go with --coordinator HOST:PORT"),
        (["--coordinator", "auto", "--process-id", "1"], "go with --coordinator HOST:PORT"),
    ],
)
def test_incomplete_multihost_flags_are_refused(flags: list[str], message: str, capsys) -> None:
    from kiln.train.__main__ import main

    with pytest.raises(SystemExit) as exit_info:
        main(["spec.json", *flags])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
