from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from kiln_testing.training import (
    EVAL_TASK,
    build_tiny_cache,
    make_spec,
    read_jsonl,
    write_eval_task,
)

from kiln.data.errors import CacheError
from kiln.train import trainer
from kiln.train.errors import TrainingDiverged, TrainingError, TrainingInterrupted
from kiln.train.metrics import WANDB_VARIABLES
from kiln.train.setup import open_data
from kiln.train.spec import parse_spec
from kiln.train.trainer import open_trainer, train

NUM_STEPS = 24  # enough that a signal sent after step 1 arrives before the end


@pytest.fixture(scope="module")
def caches(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("caches")
    return {
        "tokenized/a": build_tiny_cache(folder, "tokenized/a", 150, seed=0),
        "tokenized/b": build_tiny_cache(folder, "tokenized/b", 60, seed=1),
        "tokenized/val": build_tiny_cache(folder, "tokenized/val", 30, seed=2),
        "tokenized/val2": build_tiny_cache(folder, "tokenized/val2", 30, seed=3),
    }


def spec_for(output: Path, caches: dict[str, Path], validation=("tokenized/val",), **overrides):
    train_caches = {k: v for k, v in caches.items() if not k.startswith("tokenized/val")}
    overrides = {"weights": {"tokenized/a": 0.7, "tokenized/b": 0.3},
                 "config.num_train_steps": NUM_STEPS, "runtime.checkpointer.every": 10,
                 "runtime.validation_every": 12, **overrides}  # fmt: skip
    return parse_spec(
        make_spec(output, train_caches, {k: caches[k] for k in validation}, **overrides)
    )


def train_losses(output: Path) -> dict[int, float]:
    return {
        r["step"]: r["train/loss"]
        for r in read_jsonl(output / "metrics.jsonl")
        if "train/loss" in r
    }


# In the environment of the finished run: a secret that must reach no file the run writes.
PLANTED_API_KEY = "wandbkey-planted-0123456789abcdef0123456789"


@pytest.fixture(scope="module")
def finished_run(caches: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    """The quickstart's shape at test size: two validation sets in one group, validated at the
    start, lm-eval, and an offline W&B run with the target's tags."""
    root = tmp_path_factory.mktemp("run")
    output = root / "out"
    evals = {"tasks": [{"name": EVAL_TASK, "num_fewshot": 0, "alias": "mc"}], "every": 12,
             "task_paths": [str(write_eval_task(root / "tasks"))]}  # fmt: skip
    spec = spec_for(
        output, caches, validation=("tokenized/val", "tokenized/val2"),
        **{"runtime.control.enabled": True, "config.evals": evals,
           "runtime.validate_at_start": True,
           "runtime.validation_names": {"tokenized/val": "heldout/val",
                                        "tokenized/val2": "heldout/val2"},
           "runtime.wandb": {"mode": "offline", "project": "kiln-tests", "entity": None,
                             "run_id": None, "group": "tiny-runs", "tags": ["tiny", "ci"]}},
    )  # fmt: skip
    observed = []

    def observe(metrics_file: Path) -> None:
        observed.append((metrics_file, read_jsonl(metrics_file)[-1]["step"]))

    with pytest.MonkeyPatch.context() as env:
        for variable in WANDB_VARIABLES.values():
            env.delenv(variable, raising=False)
        env.setenv("WANDB_API_KEY", PLANTED_API_KEY)
        # After every validation (a run of seconds is otherwise observed at its end only).
        env.setattr(trainer, "OBSERVE_EVERY_SECONDS", 0.0)
        summary = train(spec, observe)
    assert [step for _, step in observed] == [0, 12, 24]
    return output, spec, summary


def test_a_run_writes_the_artifact_layout(finished_run) -> None:
    output, spec, summary = finished_run
    records = read_jsonl(output / "metrics.jsonl")
    train_lines = [r for r in records if "train/loss" in r]
    assert [r["step"] for r in train_lines] == list(range(1, NUM_STEPS + 1))
    for key in ("train/cross_entropy", "train/z_loss", "optim/learning_rate", "optim/grad_norm",
                "throughput/tokens_per_second", "throughput/step_time",
                "throughput/data_wait_seconds"):  # fmt: skip
        assert key in train_lines[-1]
    saves = [r for r in records if "throughput/checkpoint_blocked_seconds" in r]
    assert saves and saves[-1]["step"] == NUM_STEPS  # the final save, timed
    assert 0 <= summary["data_wait_seconds_p50"] <= summary["data_wait_seconds_p99"]
    assert train_lines[0]["optim/learning_rate"] == 0.0  # linear warmup from 0
    eval_lines = [r for r in records if "eval/loss" in r]
    assert [r["step"] for r in eval_lines] == [0, 12, 24]  # the start, every 12 and the end
    assert set(eval_lines[0]) == {"step", "eval/total_time", *(
        f"eval/{prefix}{metric}"
        for prefix, metrics in (("heldout/val/", ("loss", "bpb")), ("heldout/val2/", ("loss", "bpb")),
                                ("heldout/", ("macro_loss", "micro_loss", "macro_bpb", "bpb")),
                                ("", ("loss", "macro_loss", "bpb", "macro_bpb")))
        for metric in metrics
    )}  # fmt: skip
    assert eval_lines[0]["eval/loss"] > eval_lines[-1]["eval/loss"]  # step 0: the initial model

    eval_harness_lines = [r for r in records if "lm_eval/mc/acc" in r]
    assert [r["step"] for r in eval_harness_lines] == [12, 24]  # evals.every=12 and the end
    assert all(r["lm_eval/mc/acc"] in (0.0, 1 / 3, 2 / 3, 1.0) for r in eval_harness_lines)

    checkpoints = {p.name: json.loads((p / "metadata.json").read_text())
                   for p in (output / "checkpoints").iterdir()}  # fmt: skip
    assert {k: v["is_temporary"] for k, v in checkpoints.items()} == {
        "step-10": False, "step-20": False, "step-24": False
    }  # fmt: skip

    config = json.loads((output / "config.json").read_text())
    assert config["model"]["vocab_size"] == 8192 and config["spec"]["name"] == "checkpoints/tiny"
    # block = the whole run (4 x 24 sequences < 2048): 0.7 x 96 = 67.2, 0.3 x 96 = 28.8 -> 67, 29
    assert config["mixture"] == {
        "continues": None,  # no parent's data stream
        "block_size": 96,
        "sequences_per_block": {"tokenized/a": 67, "tokenized/b": 29},
    }
    (tracker,) = read_jsonl(output / "tracker_metrics.jsonl")
    assert tracker["summary"] == summary and tracker["config"] == config
    assert summary["complete"] is True and summary["step"] == NUM_STEPS
    assert summary["train/loss"] == train_lines[-1]["train/loss"] < train_lines[0]["train/loss"]
    assert summary["eval/heldout/val/loss"] == eval_lines[-1]["eval/heldout/val/loss"]
    assert summary["checkpoint"] == str(output / "checkpoints/step-24")
    assert not (output / "control/endpoint.json").exists()  # the control server stopped


def wandb_records(run_dir: Path) -> list[Any]:
    """The records of an offline W&B run's .wandb file: LevelDB-log blocks (a 7-byte file
    header, then per chunk crc32 u32, length u16, type u8) of wandb's protobuf `Record`s."""
    from wandb.proto import wandb_internal_pb2

    data = next(run_dir.glob("*.wandb")).read_bytes()
    assert data[:4] == b":W&B"
    records, pending, offset = [], b"", 7
    while offset + 7 <= len(data):
        if 32768 - offset % 32768 < 7:  # a block's tail too short for a header is padding
            offset += 32768 - offset % 32768
            continue
        length, kind = int.from_bytes(data[offset + 4 : offset + 6], "little"), data[offset + 6]
        pending += data[offset + 7 : offset + 7 + length]
        offset += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def test_the_wandb_run_carries_the_settings_and_tags(finished_run) -> None:
    output, spec, summary = finished_run
    (run_dir,) = (output / "wandb").glob("offline-run-*-checkpoints-tiny-2026.11.29")
    runs = [r.run for r in wandb_records(run_dir) if r.WhichOneof("record_type") == "run"]
    assert runs, "the offline run file holds no run record"
    assert (runs[0].project, runs[0].run_group, list(runs[0].tags)) == (
        "kiln-tests", "tiny-runs", ["tiny", "ci"]
    )  # fmt: skip
    config = json.loads((output / "config.json").read_text())
    assert config["wandb"] == {"mode": "offline", "project": "kiln-tests", "entity": None,
                               "group": "tiny-runs", "run_id": "checkpoints-tiny-2026.11.29",
                               "tags": ["tiny", "ci"]}  # fmt: skip


def test_secrets_in_the_environment_reach_no_file_of_the_run(finished_run) -> None:
    output, spec, summary = finished_run
    leaked = [p for p in output.rglob("*")
              if p.is_file() and PLANTED_API_KEY.encode() in p.read_bytes()]  # fmt: skip
    assert leaked == []


def test_rerunning_a_finished_run_trains_nothing(finished_run) -> None:
    output, spec, summary = finished_run
    before = (output / "metrics.jsonl").read_text()
    again = train(spec)
    assert again["steps_this_run"] == 0 and again["complete"] is True
    assert again["train/loss"] == summary["train/loss"]
    assert (output / "metrics.jsonl").read_text() == before


def test_stopping_early_then_resuming_matches_the_uninterrupted_run(
    finished_run, caches, tmp_path
) -> None:
    reference_output, _, reference = finished_run
    output = tmp_path / "out"

    def broken_observer(metrics_file: Path) -> None:
        raise OSError("disk full")

    spec = spec_for(output, caches, **{"runtime.max_steps_this_run": 3})
    # Hooks added from outside run after the trainer's own, handed the step and the state.
    seen: dict[str, list[tuple[int, int]]] = {"every 2": [], "every sync point": []}
    with open_trainer(spec, broken_observer) as trainer:
        for name, every in (("every 2", 2), ("every sync point", None)):
            trainer.hooks.add_hook(
                lambda point, name=name: seen[name].append((point.step, int(point.state.step))),
                every=every,
            )
        first = trainer.run().summary  # an observer's failure is logged, never fatal
    assert seen == {"every 2": [(2, 2)], "every sync point": [(2, 2), (3, 3)]}
    assert first["complete"] is False and first["step"] == 3
    assert json.loads((output / "checkpoints/step-3/metadata.json").read_text())["is_temporary"]
    assert not (output / "tracker_metrics.jsonl").exists()
    second = train(spec_for(output, caches))
    assert second["complete"] is True and second["steps_this_run"] == NUM_STEPS - 3
    # Bit-for-bit: same batches (a pure function of the step), same restored state, same XLA.
    assert train_losses(output) == train_losses(reference_output)
    assert second["eval/val/loss"] == reference["eval/heldout/val/loss"]  # same set, windows
    assert sorted(p.name for p in (output / "checkpoints").iterdir()) == [
        "step-10",
        "step-20",
        "step-24",
    ]


def test_gradient_accumulation_follows_the_one_pass_run(finished_run, caches, tmp_path) -> None:
    reference_output, _, _ = finished_run
    output = tmp_path / "out"
    overrides = {"runtime.per_device_parallelism": 2, "runtime.max_steps_this_run": 3}
    train(spec_for(output, caches, **overrides))
    assert json.loads((output / "config.json").read_text())["microbatches"] == 2
    # Same batches, same update up to float summation order.
    losses, reference = train_losses(output), train_losses(reference_output)
    assert sorted(losses) == [1, 2, 3]
    np.testing.assert_allclose(
        [losses[step] for step in (1, 2, 3)], [reference[step] for step in (1, 2, 3)], rtol=1e-5
    )
    with pytest.raises(TrainingError, match="per_device_parallelism=3 .* batch_size=4"):
        train(spec_for(tmp_path / "bad", caches, **{"runtime.per_device_parallelism": 3}))


def test_datasets_must_share_one_tokenizer(caches, tmp_path) -> None:
    gpt2 = build_tiny_cache(
        tmp_path, "tokenized/gpt2", 5, seed=3, tokenizer={"kind": "package", "name": "gpt2"}
    )
    spec = spec_for(tmp_path / "out", {**caches, "tokenized/b": gpt2})
    with pytest.raises(
        CacheError, match="different tokenizers.*tokenized/a: kiln-stdlib-8k.*tokenized/b: gpt2"
    ):
        open_data(spec)


def test_a_gpu_spec_refuses_to_run_on_cpu(caches, tmp_path) -> None:
    spec = spec_for(
        tmp_path / "out",
        caches,
        **{"runtime.resources": {"kind": "gpu", "type": "H100", "count": 8}},
    )
    with pytest.raises(TrainingError, match="asks for gpu but jax found only cpu devices"):
        train(spec)


def test_a_mesh_this_machine_cannot_hold_is_a_clear_error(caches, tmp_path) -> None:
    spec = spec_for(tmp_path / "out", caches, **{"runtime.mesh": {"data": 2}})
    with pytest.raises(TrainingError, match="runtime.mesh: .*needs a multiple of 2 devices"):
        train(spec)


def test_a_missing_cache_names_the_dataset(caches, tmp_path) -> None:
    spec = spec_for(tmp_path / "out", {**caches, "tokenized/b": tmp_path / "nowhere"})
    with pytest.raises(
        CacheError, match="dataset tokenized/b .*nowhere.*not a finished token cache"
    ):
        open_data(spec)


def test_an_eval_task_that_cannot_load_fails_before_training(caches, tmp_path) -> None:
    task_dir = write_eval_task(tmp_path / "tasks")
    (task_dir / "mc.jsonl").unlink()  # its data is gone
    evals = {"tasks": [{"name": EVAL_TASK, "num_fewshot": 0}], "every": 10,
             "task_paths": [str(task_dir)]}  # fmt: skip
    spec = spec_for(tmp_path / "out", caches, **{"config.evals": evals})
    with pytest.raises(TrainingError, match=f"config.evals: cannot load the data of .*{EVAL_TASK}"):
        train(spec)
    assert not (tmp_path / "out/metrics.jsonl").exists()


def test_a_control_endpoint_request_saves_a_temporary_checkpoint(caches, tmp_path, capsys) -> None:
    from kiln.control.__main__ import mint

    output = tmp_path / "out"
    spec = spec_for(
        output, caches, **{"runtime.control.enabled": True, "runtime.checkpointer.every": None}
    )
    answers = []

    def request_after_first_step() -> None:
        while not (output / "metrics.jsonl").exists() or not (output / "metrics.jsonl").read_text():
            time.sleep(0.005)
        request = urllib.request.Request(
            mint(output, ttl_minutes=5) + "checkpoint", data=b"", method="POST",
            headers={"X-Levanter-Training-Control": "request-checkpoint"},
        )  # fmt: skip
        with urllib.request.urlopen(request) as response:
            answers.append(response.status)

    requester = threading.Thread(target=request_after_first_step, daemon=True)
    requester.start()
    train(spec)
    requester.join(timeout=10)
    assert answers == [202]
    saves = [line for line in capsys.readouterr().out.splitlines() if line.startswith("saved ")]
    assert (
        len(saves) == 2
        and saves[-1].startswith(
            f"saved permanent checkpoint {output}/checkpoints/step-{NUM_STEPS} (training held up "
        )
    )
    assert saves[0].startswith(f"saved temporary checkpoint {output}/checkpoints/step-")


def test_divergence_stops_without_saving_the_bad_state(caches, tmp_path) -> None:
    output = tmp_path / "out"
    spec = spec_for(output, caches, **{"config.optimizer.learning_rate": 1e30,
                                       "config.optimizer.warmup": 0,
                                       "runtime.checkpointer.every": 1})  # fmt: skip
    with pytest.raises(TrainingDiverged, match="non-finite training loss at step 2.*step-1") as e:
        train(spec)
    assert e.value.exit_code == 2
    assert sorted(p.name for p in (output / "checkpoints").iterdir()) == ["step-1"]
    assert not (output / "tracker_metrics.jsonl").exists()


def test_sigint_saves_a_temporary_checkpoint_and_stops(caches, tmp_path) -> None:
    output = tmp_path / "out"
    spec = spec_for(output, caches, **{"runtime.checkpointer.every": None})

    def interrupt_after_first_step() -> None:
        while not (output / "metrics.jsonl").exists() or not (output / "metrics.jsonl").read_text():
            time.sleep(0.005)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt_after_first_step, daemon=True).start()
    with pytest.raises(
        TrainingInterrupted, match="interrupted by SIGINT after step .*Rerun to resume"
    ) as e:
        train(spec)
    assert e.value.exit_code == 128 + signal.SIGINT
    (saved,) = (output / "checkpoints").iterdir()
    meta = json.loads((saved / "metadata.json").read_text())
    assert meta["is_temporary"] and 1 <= meta["step"] < NUM_STEPS
    assert max(train_losses(output)) == meta["step"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handlers restored


def test_a_second_start_reads_its_step_from_the_compilation_cache(
    caches, tmp_path, monkeypatch
) -> None:
    import jax

    from kiln.train import compilation_cache

    tests_cache = compilation_cache.active_folder()
    monkeypatch.delenv(compilation_cache.DIRECTORY_VARIABLE)
    folder = tmp_path / "store" / compilation_cache.STORE_FOLDER
    output = tmp_path / "out"
    spec = spec_for(output, caches, validation=(), **{"runtime.max_steps_this_run": 1})
    try:
        assert compilation_cache.use(folder) == str(folder)
        jax.clear_caches()  # this process compiled the step already: start as a new one would
        cold = train(spec)
        jax.clear_caches()
        warm = train(spec)  # resumes from step 1's checkpoint, as a restarted run does
    finally:
        compilation_cache.use(Path(tests_cache) if tests_cache else None)
    assert (cold["first_step_program"], warm["first_step_program"]) == ("compiled", "cache")
    assert cold["compilation_cache"] == warm["compilation_cache"] == str(folder)
    assert any(folder.iterdir())
    lines = read_jsonl(output / "metrics.jsonl")
    firsts = [r for r in lines if "throughput/first_step_seconds" in r]
    assert [(r["step"], r["throughput/first_step_from_cache"]) for r in firsts] == [
        (1, 0.0),
        (2, 1.0),
    ]
    assert warm["first_step_seconds"] == firsts[1]["throughput/first_step_seconds"] > 0
