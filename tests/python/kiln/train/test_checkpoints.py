from __future__ import annotations

import hashlib
import json
import logging
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kiln.model.config import LlamaConfig
from kiln.train.checkpoint_params import restore_params
from kiln.train.checkpoints import (
    METADATA_FILE,
    CheckpointDamaged,
    Checkpointer,
    damage,
    read_checkpoint,
)
from kiln.train.mesh import make_mesh
from kiln.train.optimizer import AdamConfig
from kiln.train.step import ModelOptions, abstract_train_state, init_train_state


class FakeClock:
    """Minutes of training pass at the test's command (the save interval is by time)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def state_at(step: int) -> dict:
    return {
        "params": {"w": jnp.full((3, 4), float(step)), "b": jnp.arange(3, dtype=jnp.bfloat16)},
        "step": jnp.asarray(step, jnp.int32),
    }


def make_checkpointer(tmp_path: Path, clock: FakeClock, temporary_root: Path | None = None, **kw):
    options = {"save_interval_seconds": 600.0, "keep_last_temporary": 2, "every": 10} | kw
    root = tmp_path / "checkpoints"
    return Checkpointer(root, temporary_root or root, clock=clock, **options)


def steps(checkpointer: Checkpointer) -> list[tuple[int, bool]]:
    return [(c.step, c.is_temporary) for c in checkpointer.complete()]


def test_save_then_restore_is_exact(tmp_path: Path) -> None:
    checkpointer = make_checkpointer(tmp_path, FakeClock())
    info = checkpointer.save(3, state_at(3), temporary=True)
    meta = json.loads((info.path / METADATA_FILE).read_text())
    assert info.path == tmp_path / "checkpoints/step-3"
    assert meta["step"] == 3 and meta["is_temporary"] is True and meta["timestamp"] > 0
    restored = checkpointer.restore(checkpointer.latest(), state_at(0))
    np.testing.assert_array_equal(restored["params"]["w"], state_at(3)["params"]["w"])
    assert restored["params"]["b"].dtype == jnp.bfloat16 and int(restored["step"]) == 3
    checkpointer.close()


def test_an_asynchronous_save_counts_only_once_committed(tmp_path: Path) -> None:
    checkpointer = make_checkpointer(tmp_path, FakeClock())
    checkpointer.save(10, state_at(10), temporary=False)
    temporary = checkpointer.save(12, state_at(12), temporary=True)
    state = state_at(20)
    assert checkpointer.begin_save(20, state, temporary=False) is None  # writing in the background
    # Training goes on: the next step donates (frees) the state's buffers; orbax has a copy.
    for leaf in jax.tree.leaves(state):
        leaf.delete()
    assert checkpointer.latest().step == 12 and temporary.path.exists()  # nothing pruned yet
    info = checkpointer.commit()
    assert info is not None and checkpointer.latest() == info and not checkpointer.writing()
    assert steps(checkpointer) == [(10, False), (20, False)]  # the permanent pruned step 12
    restored = checkpointer.restore(info, state_at(0))
    np.testing.assert_array_equal(restored["params"]["w"], state_at(20)["params"]["w"])
    assert checkpointer.commit() is None  # nothing left in progress
    assert checkpointer.begin_save(20, state, temporary=True) == info  # saved already
    checkpointer.close()


def test_close_completes_a_save_in_progress(tmp_path: Path) -> None:
    checkpointer = make_checkpointer(tmp_path, FakeClock())
    checkpointer.begin_save(4, state_at(4), temporary=True)
    checkpointer.close()  # a run ending on an error keeps the checkpoint it had begun
    assert steps(make_checkpointer(tmp_path, FakeClock())) == [(4, True)]


def test_due_by_step_by_time_and_on_request(tmp_path: Path) -> None:
    clock = FakeClock()
    checkpointer = make_checkpointer(tmp_path, clock)
    assert checkpointer.due(1) is None
    assert checkpointer.due(1, requested=True) == "temporary"
    assert checkpointer.due(10) == "permanent" and checkpointer.due(7, final=True) == "permanent"
    clock.now = 599.0
    assert checkpointer.due(2) is None
    clock.now = 600.0
    assert checkpointer.due(2) == "temporary"
    checkpointer.save(2, state_at(2), temporary=True)
    assert checkpointer.due(3) is None  # the interval restarts at each save
    checkpointer.close()


def test_temporaries_roll_and_a_permanent_prunes_them(tmp_path: Path) -> None:
    checkpointer = make_checkpointer(tmp_path, FakeClock())
    for step in (1, 2, 3):
        checkpointer.save(step, state_at(step), temporary=True)
    assert steps(checkpointer) == [(2, True), (3, True)]  # keep_last_temporary = 2
    checkpointer.save(4, state_at(4), temporary=False)
    checkpointer.save(5, state_at(5), temporary=True)
    assert steps(checkpointer) == [(4, False), (5, True)]
    assert not (tmp_path / "checkpoints/step-3").exists()
    checkpointer.close()


def test_a_permanent_save_promotes_a_temporary_of_the_same_step(tmp_path: Path) -> None:
    checkpointer = make_checkpointer(tmp_path, FakeClock())
    checkpointer.save(6, state_at(6), temporary=True)
    checkpointer.save(6, state_at(6), temporary=False)
    assert steps(checkpointer) == [(6, False)]
    assert checkpointer.save(6, state_at(6), temporary=True).is_temporary is False
    checkpointer.close()


def test_killed_saves_are_removed_and_step_folders_without_metadata_kept_aside(
    tmp_path: Path,
) -> None:
    """A killed save is a `.step-N.saving` folder: removed. A step folder only ever appears
    complete (renamed last), so one whose metadata.json is gone or torn is damaged: moved aside,
    never deleted."""
    checkpointer = make_checkpointer(tmp_path, FakeClock())
    checkpointer.save(4, state_at(4), temporary=False)
    gone = checkpointer.save(8, state_at(8), temporary=False).path
    torn = checkpointer.save(12, state_at(12), temporary=False).path
    (gone / METADATA_FILE).unlink()
    (torn / METADATA_FILE).write_text((torn / METADATA_FILE).read_text()[:20])  # truncated
    killed = tmp_path / "checkpoints/.step-16.saving"
    (killed / "state.orbax-checkpoint-tmp").mkdir(parents=True)
    assert read_checkpoint(gone) is None and read_checkpoint(torn) is None
    assert checkpointer.latest().step == 4
    assert checkpointer.remove_incomplete() == [killed]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "step-12.damaged", "step-4", "step-8.damaged"]  # fmt: skip
    assert (tmp_path / "checkpoints/step-12.damaged/state").is_dir()  # its files kept
    checkpointer.close()


def test_resume_takes_the_newest_across_both_roots(tmp_path: Path) -> None:
    temporary_root = tmp_path / "scratch/checkpoints"
    checkpointer = make_checkpointer(tmp_path, FakeClock(), temporary_root=temporary_root)
    checkpointer.save(10, state_at(10), temporary=False)
    checkpointer.save(12, state_at(12), temporary=True)
    assert (temporary_root / "step-12").is_dir() and (tmp_path / "checkpoints/step-10").is_dir()
    latest = checkpointer.latest()
    assert (latest.step, latest.is_temporary) == (12, True)
    assert int(checkpointer.restore(latest, state_at(0))["step"]) == 12
    checkpointer.save(20, state_at(20), temporary=False)
    assert steps(checkpointer) == [(10, False), (20, False)]  # the permanent pruned step-12
    checkpointer.close()


def largest_state_file(info) -> Path:
    return max((p for p in (info.path / "state").rglob("*") if p.is_file()), key=_size)


def _size(path: Path) -> int:
    return path.stat().st_size


def test_the_metadata_records_the_state_files_sizes_and_digests(tmp_path: Path) -> None:
    checkpointer = make_checkpointer(tmp_path, FakeClock())
    info = checkpointer.save(3, state_at(3), temporary=True)
    files = json.loads((info.path / METADATA_FILE).read_text())["files"]
    on_disk = {str(p.relative_to(info.path / "state")): (_size(p), _sha256(p))
               for p in (info.path / "state").rglob("*") if p.is_file()}  # fmt: skip
    assert {name: (f["bytes"], f["sha256"]) for name, f in files.items()} == on_disk
    promoted = checkpointer.save(3, state_at(3), temporary=False)  # the same files, kept
    assert json.loads((promoted.path / METADATA_FILE).read_text())["files"] == files
    checkpointer.close()


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # same size: only the digest can tell
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda f: f.write_bytes(f.read_bytes()[:-7]), r"has \d+ bytes, \d+ were written"),
        (lambda f: f.unlink(), "is missing"),
        (_flip_a_byte, r"does not match its sha256 digest \(its bytes changed\)"),
    ],
    ids=["truncated", "deleted", "one byte flipped"],
)
def test_a_damaged_checkpoint_is_skipped_for_the_previous_one(
    tmp_path: Path, caplog, damage, reason
) -> None:
    checkpointer = make_checkpointer(tmp_path, FakeClock())
    checkpointer.save(4, state_at(4), temporary=False)
    newest = checkpointer.save(8, state_at(8), temporary=True)
    damaged = largest_state_file(newest)
    damage(damaged)
    with caplog.at_level(logging.WARNING, logger="kiln.train.checkpoints"):
        state, info = checkpointer.restore_latest(state_at(0))
    assert info.step == 4 and int(state["step"]) == 4
    relative = damaged.relative_to(newest.path)
    assert re.search(rf"skipping checkpoint {newest.path}: {relative} {reason}", caplog.text)
    aside = newest.path.with_name("step-8.damaged")
    assert aside.is_dir() and not newest.path.exists()  # kept for a person to inspect
    assert steps(checkpointer) == [(4, False)]  # and never counted again
    checkpointer.close()


def test_a_damaged_checkpoint_never_displaces_the_last_good_one(tmp_path: Path) -> None:
    """Rolling retention after a resume past a damaged checkpoint: the good one it resumed from
    stays, and the damaged one neither counts as kept nor answers for its step again."""
    checkpointer = make_checkpointer(tmp_path, FakeClock(), keep_last_temporary=2, every=None)
    checkpointer.save(2, state_at(2), temporary=True)
    damaged = checkpointer.save(6, state_at(6), temporary=True)
    _flip_a_byte(largest_state_file(damaged))
    _, resumed = checkpointer.restore_latest(state_at(0))
    assert resumed.step == 2
    checkpointer.save(4, state_at(4), temporary=True)
    assert steps(checkpointer) == [(2, True), (4, True)]
    again = checkpointer.save(6, state_at(6), temporary=True)  # a fresh save of that step
    assert damage(again) is None and steps(checkpointer) == [(4, True), (6, True)]
    assert (tmp_path / "checkpoints/step-6.damaged").is_dir()
    checkpointer.close()


def test_when_every_checkpoint_is_damaged_they_stay_where_they_are(tmp_path: Path) -> None:
    checkpointer = make_checkpointer(tmp_path, FakeClock())
    only = checkpointer.save(4, state_at(4), temporary=False)
    _flip_a_byte(largest_state_file(only))
    with pytest.raises(CheckpointDamaged):
        checkpointer.restore_latest(state_at(0))
    assert steps(checkpointer) == [(4, False)]  # a rerun stops again rather than start over
    checkpointer.close()


def test_a_checkpoint_orbax_cannot_read_is_skipped(tmp_path: Path, caplog) -> None:
    checkpointer = make_checkpointer(tmp_path, FakeClock())
    checkpointer.save(4, state_at(4), temporary=False)
    newest = checkpointer.save(8, state_at(8), temporary=True)
    meta = json.loads((newest.path / METADATA_FILE).read_text())
    del meta["files"]  # saved without records: orbax's own reading is the check
    (newest.path / METADATA_FILE).write_text(json.dumps(meta))
    chunk = largest_state_file(newest)
    chunk.write_bytes(bytes(len(chunk.read_bytes())))  # same size, every byte zero
    with caplog.at_level(logging.WARNING, logger="kiln.train.checkpoints"):
        _, info = checkpointer.restore_latest(state_at(0))
    assert info.step == 4
    assert f"skipping checkpoint {newest.path}: orbax cannot restore it" in caplog.text
    checkpointer.close()


def test_when_every_checkpoint_is_damaged_the_run_stops(tmp_path: Path) -> None:
    checkpointer = make_checkpointer(tmp_path, FakeClock())
    assert checkpointer.restore_latest(state_at(0)) is None  # nothing saved: start afresh
    only = checkpointer.save(4, state_at(4), temporary=False)
    largest_state_file(only).unlink()
    with pytest.raises(
        CheckpointDamaged, match=f"no checkpoint of this run can be restored: {only.path}"
    ):
        checkpointer.restore_latest(state_at(0))
    checkpointer.close()


def test_a_checkpoint_saved_without_sizes_still_restores(tmp_path: Path) -> None:
    checkpointer = make_checkpointer(tmp_path, FakeClock())
    info = checkpointer.save(5, state_at(5), temporary=False)
    meta = json.loads((info.path / METADATA_FILE).read_text())
    del meta["files"]
    (info.path / METADATA_FILE).write_text(json.dumps(meta))
    assert checkpointer.restore_latest(state_at(0))[1].step == 5
    checkpointer.close()


@pytest.mark.parametrize("metadata", ["{", '{"step": 3}', ""])
def test_unreadable_metadata_means_incomplete(tmp_path: Path, metadata: str) -> None:
    folder = tmp_path / "step-3"
    folder.mkdir()
    (folder / METADATA_FILE).write_text(metadata)
    assert read_checkpoint(folder) is None


def test_restore_params_reads_the_model_alone_as_the_trainer_restores_it(tmp_path: Path) -> None:
    model = LlamaConfig(
        max_seq_len=16, hidden_dim=32, intermediate_dim=64, num_heads=2, num_kv_heads=1,
        num_layers=1, vocab_size=48,
    )  # fmt: skip
    adam = AdamConfig(learning_rate=1e-2, warmup=2)
    options = {"compute_dtype": "bfloat16", "param_dtype": "float32"}
    mesh = make_mesh()
    state_options = ModelOptions(**options, attention="xla")
    state = init_train_state(model, adam, 10, seed=3, mesh=mesh, options=state_options)
    checkpointer = make_checkpointer(tmp_path, FakeClock())
    info = checkpointer.save(7, state, temporary=False)
    resumed = checkpointer.restore(
        info, abstract_train_state(model, adam, 10, mesh=mesh, options=state_options)
    )
    checkpointer.close()

    graphdef, params = restore_params(info, model, mesh=mesh, **options)

    assert graphdef == resumed.graphdef
    assert jax.tree.structure(params) == jax.tree.structure(state.params)
    for leaf, saved, resumed_leaf in zip(
        *map(jax.tree.leaves, (params, state.params, resumed.params))
    ):
        np.testing.assert_array_equal(leaf, saved)
        assert leaf.dtype == saved.dtype and leaf.sharding == resumed_leaf.sharding
    tokens = jnp.arange(12, dtype=jnp.int32).reshape(2, 6)
    np.testing.assert_array_equal(
        nnx.merge(graphdef, params)(tokens), nnx.merge(state.graphdef, state.params)(tokens)
    )


def test_restore_params_refuses_a_damaged_checkpoint(tmp_path: Path) -> None:
    """What reads the model alone (samples, export) never reads changed bytes as weights."""
    model = LlamaConfig(
        max_seq_len=16, hidden_dim=32, intermediate_dim=64, num_heads=2, num_kv_heads=1,
        num_layers=1, vocab_size=48,
    )  # fmt: skip
    options = {"compute_dtype": "float32", "param_dtype": "float32"}
    mesh = make_mesh()
    state = init_train_state(
        model, AdamConfig(learning_rate=1e-2, warmup=2), 10, seed=3, mesh=mesh,
        options=ModelOptions(**options, attention="xla"),
    )  # fmt: skip
    checkpointer = make_checkpointer(tmp_path, FakeClock())
    info = checkpointer.save(7, state, temporary=False)
    checkpointer.close()
    damaged = largest_state_file(info)
    _flip_a_byte(damaged)
    relative = damaged.relative_to(info.path)
    with pytest.raises(CheckpointDamaged, match=rf"{info.path} is damaged: {relative} does not"):
        restore_params(info, model, mesh=mesh, **options)
