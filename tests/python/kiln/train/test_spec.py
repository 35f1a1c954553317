from __future__ import annotations

import copy
import dataclasses
import json
import re
from pathlib import Path

import pytest
from kiln_testing.training import EXAMPLE_SPEC, delete_field, set_field

from kiln.model.config import LlamaConfig
from kiln.train.spec import SpecError, load_spec, parse_spec


def spec_with(**changes) -> dict:
    spec = copy.deepcopy(EXAMPLE_SPEC)
    for dotted, value in changes.items():
        set_field(spec, dotted, value)
    return spec


def spec_without(dotted: str) -> dict:
    spec = copy.deepcopy(EXAMPLE_SPEC)
    delete_field(spec, dotted)
    return spec


def test_example_spec_parses_into_dataclasses(tmp_path: Path) -> None:
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(EXAMPLE_SPEC))
    spec = load_spec(path)
    assert spec.name == "checkpoints/tiny" and spec.output_path == Path("/tmp/kiln-never-written")
    assert spec.config.optimizer.learning_rate == 3e-3 and spec.config.optimizer.warmup == 3
    assert spec.config.datasets[0].weight == 3.8 and spec.config.datasets[0].path == Path("/data/a")
    assert spec.config.validation[0].weight == 0.0
    assert spec.runtime.mesh == {"data": -1, "fsdp": 1, "tensor": 1}
    assert spec.runtime.checkpointer.every == 5
    assert spec.runtime.checkpointer.temporary_base_path is None
    assert spec.config.z_loss_weight == 1e-4 and spec.config.evals is None
    model = LlamaConfig.for_vocabulary(spec.config.model, vocab_size=8192)
    assert model.vocab_size == 8192 and model.hidden_dim == 64


def test_the_example_spec_round_trips() -> None:
    spec = parse_spec(EXAMPLE_SPEC)
    assert spec.to_json() == EXAMPLE_SPEC
    assert parse_spec(spec.to_json()) == spec


def test_a_staged_runs_record_names_the_bucket_and_reads_back_from_a_local_view(
    tmp_path: Path,
) -> None:
    """train_spec.json of a run staged on a host names the bucket, not the staging folder;
    read from a local view of the artifact, the view is the output and the bucket the location."""
    url = "s3://bucket/kiln/checkpoints/tiny/2026.11.29"
    staged = dataclasses.replace(parse_spec(EXAMPLE_SPEC), location=url)
    record = staged.record_json()
    assert record["output_path"] == url and str(staged.output_path) not in json.dumps(record)
    view = tmp_path / "view"
    view.mkdir()
    (view / "train_spec.json").write_text(json.dumps(record))
    loaded = load_spec(view / "train_spec.json")
    assert (loaded.output_path, loaded.location) == (view, url)
    assert loaded.config == staged.config and loaded.runtime == staged.runtime
    assert parse_spec(EXAMPLE_SPEC).record_json() == EXAMPLE_SPEC  # not staged: as it is


def test_a_dataset_in_a_bucket_keeps_its_url() -> None:
    spec = parse_spec(spec_with(**{"config.datasets.0.path": "gs://b/tokenized/a/v1"}))
    assert spec.config.datasets[0].path == "gs://b/tokenized/a/v1"  # not a Path: no `//` folded
    assert spec.to_json()["config"]["datasets"][0]["path"] == "gs://b/tokenized/a/v1"


def test_evals_and_optional_nulls() -> None:
    tasks = [{"name": "hellaswag", "num_fewshot": 0, "alias": "hellaswag_0shot"}]
    spec = parse_spec(
        spec_with(
            **{
                "config.evals": {"tasks": tasks, "every": 100, "max_examples": None},
                "config.z_loss_weight": None,
                "runtime.checkpointer.every": None,
                "runtime.checkpointer.temporary_base_path": "/scratch/tmp",
            }
        )
    )
    assert spec.config.evals.to_json() == {
        "tasks": tasks, "every": 100, "max_examples": None, "task_paths": []
    }  # fmt: skip
    assert spec.config.z_loss_weight is None and spec.runtime.checkpointer.every is None
    assert spec.runtime.checkpointer.temporary_base_path == Path("/scratch/tmp")


@pytest.mark.parametrize(
    "spec, message",
    [
        (spec_with(spec_version=2), "spec_version"),
        (spec_with(kind="tokenized_cache"), "kind"),
        (spec_with(**{"config.batch_size": 0}), "config.batch_size"),
        (spec_with(**{"config.batch_size": "8"}), "config.batch_size"),
        (spec_with(**{"config.seq_len": True}), "config.seq_len"),
        (
            spec_with(**{"config.seq_len": 128}),
            "config.seq_len: 128 exceeds model.max_seq_len 64",
        ),
        (spec_with(**{"config.compute_dtype": "fp8"}), "config.compute_dtype"),
        (spec_with(**{"config.datasets": []}), "config.datasets"),
        (spec_with(**{"config.datasets.0.weight": 0}), "weight > 0"),
        (spec_with(**{"config.datasets.0.weight": -1}), "config.datasets[0].weight"),
        (
            spec_with(**{"config.datasets.0.path": "relative/dir"}),
            "config.datasets[0].path: expected an absolute path or a bucket URL",
        ),
        (
            spec_with(**{"config.validation.0.path": "hdfs://b/val"}),
            "config.validation[0].path: expected an absolute path or a bucket URL "
            "(s3://BUCKET/PATH, gs://BUCKET/PATH), got 'hdfs://b/val'",
        ),
        (
            spec_with(**{"config.datasets.0.colour": "red"}),
            "config.datasets[0]: unknown field(s) colour",
        ),
        (
            spec_with(**{"config.validation.0.weight": 1}),
            "config.validation[0]: unknown field(s) weight",
        ),
        (spec_with(**{"config.model.num_heads": 3}), "config.model"),
        (spec_with(**{"config.model.hiden_dim": 64}), "config.model"),
        (spec_with(**{"config.optimizer.lr_schedule": "cyclic"}), "config.optimizer"),
        (
            spec_with(**{"config.evals": {"tasks": [{"nme": "x"}], "every": 10}}),
            "config.evals.tasks[0]",
        ),
        (spec_with(**{"config.seed": -1}), "config.seed"),
        (spec_with(**{"runtime.mesh": {"data": -1, "fsdp": -1}}), "runtime.mesh"),
        (spec_with(**{"runtime.mesh": {"data": 0}}), "runtime.mesh.data"),
        (spec_with(**{"runtime.attention": "flash"}), "runtime.attention"),
        (spec_with(**{"runtime.checkpointer.keep_last_temporary": 0}), "keep_last_temporary"),
        (spec_with(**{"runtime.wandb.mode": "cloud"}), "runtime.wandb.mode"),
        (spec_with(**{"runtime.wandb.tags": "a,b"}), "runtime.wandb.tags: expected a JSON list"),
        (spec_with(**{"runtime.max_eval_batches": 0}), "runtime.max_eval_batches"),
        (
            spec_with(**{"runtime.validation_names": {"tokenized/val": "paloma/"}}),
            "runtime.validation_names.tokenized/val: expected a name of `/`-separated parts",
        ),
        (
            spec_with(**{"runtime.validation_names": {"tokenized/other": "x"}}),
            "runtime.validation_names.tokenized/other: is not one of config.validation",
        ),
        (spec_with(**{"runtime.control.port": 70000}), "runtime.control.port"),
        (spec_with(**{"runtime.speed": "fast"}), "runtime: unknown field(s) speed"),
        (
            spec_without("config.num_train_steps"),
            "config.num_train_steps: required field is missing",
        ),
        (spec_without("runtime.checkpointer"), "runtime.checkpointer: required field is missing"),
    ],
)
def test_bad_specs_name_the_field(spec: dict, message: str) -> None:
    with pytest.raises(SpecError, match=re.escape(message)):
        parse_spec(spec)


def test_duplicate_dataset_names_are_refused() -> None:
    spec = copy.deepcopy(EXAMPLE_SPEC)
    spec["config"]["datasets"] *= 2
    with pytest.raises(SpecError, match="config.datasets: dataset.*twice: tokenized/a"):
        parse_spec(spec)


def test_the_vocabulary_size_comes_from_the_caches_not_the_spec() -> None:
    with pytest.raises(SpecError, match=r"config.model: unknown field\(s\) vocab_size"):
        parse_spec(spec_with(**{"config.model.vocab_size": 1000}))


def test_unreadable_and_invalid_files(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="cannot read the train spec"):
        load_spec(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(SpecError, match="bad.json is not valid JSON"):
        load_spec(tmp_path / "bad.json")


def test_validation_set_names_are_unique_and_no_set_is_a_group() -> None:
    second = {**EXAMPLE_SPEC["config"]["validation"][0], "name": "tokenized/more/val2"}
    two_sets = {"config.validation": [*EXAMPLE_SPEC["config"]["validation"], second]}
    spec = parse_spec(spec_with(**two_sets))
    assert spec.runtime.eval_names(spec.config.validation) == ("val", "val2")  # last parts
    named = {"tokenized/val": "paloma/c4_en", "tokenized/more/val2": "paloma/ptb"}
    spec = parse_spec(spec_with(**two_sets, **{"runtime.validation_names": named}))
    assert spec.runtime.eval_names(spec.config.validation) == ("paloma/c4_en", "paloma/ptb")
    for names, problem in [
        ({"tokenized/val": "x", "tokenized/more/val2": "x"}, "validation set name(s) used twice: x"),
        ({"tokenized/val": "paloma", "tokenized/more/val2": "paloma/ptb"},
         "paloma name(s) a validation set and a group of others"),
    ]:  # fmt: skip
        with pytest.raises(SpecError, match=re.escape(f"runtime.validation_names: {problem}")):
            parse_spec(spec_with(**two_sets, **{"runtime.validation_names": names}))
