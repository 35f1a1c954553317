"""An evaluation as an artifact of the store (an `lm_eval_run` target, docs/evals.md).

`python -m kiln.interop eval-artifact OUT --record RECORD.json --prefix PREFIX --validation
NAME=LOCATION... [--task-files DIR...]`: the record's identity says what is scored and how (the
model: a run of the graph at a step, an export, or published weights; the suite; the validation
sets; seq_len, batch_size, max_eval_batches, compute_dtype); the command line says where the
validation caches and local task files are. A run or export of the graph is found by its
`name/version` in the store at PREFIX and must be built with the fingerprint the record names
(kiln.interop.parent_run). The scores are those a training run reports for the same model
(kiln.interop.evaluate: the trainer's eval step and lm-eval adapter), written to `results.json`
beside the record, STATUS last; an artifact built with this fingerprint is served.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kiln import artifacts
from kiln.artifacts.atomic import atomic_write_json
from kiln.artifacts.folder import ArtifactFolder
from kiln.artifacts.store import ObjectStore
from kiln.interop.errors import InteropError
from kiln.interop.evaluate import (
    EvalRequest,
    ValidationCache,
    evaluate_hf_llama,
    evaluate_model,
)
from kiln.interop.hub import hf_model_folder
from kiln.interop.parent_run import built_parent
from kiln.interop.read import ImportedLlama
from kiln.interop.store_artifact import (
    read_record,
    served_if_built,
    writing,
)
from kiln.interop.trained_run import TrainedRun
from kiln.train.run_mirror import local_run
from kiln_contract.layout import EVAL_RESULTS_FILE
from kiln_contract.train import HfModelSource, ParentRun, init_from_json


def evaluate_artifact(
    out: str,
    record_file: Path,
    store: ObjectStore,
    validation: tuple[ValidationCache, ...],
    task_paths: tuple[str, ...],
) -> str:
    """Builds (or serves) the evaluation at `out`; returns what it did, for people."""
    record, provenance = read_record(record_file)
    target = ArtifactFolder.at(out)
    already = served_if_built(target, record, provenance)
    if already is not None:
        return already
    identity = record.identity
    model = init_from_json(identity["model"], "identity.model")
    request = eval_request(identity, validation, task_paths)
    metrics = _scores(model, store, request)
    full_record = {**record.to_json(), "provenance": {**provenance, **artifacts.built_here()}}
    with writing(target) as local:
        local.mkdir(parents=True, exist_ok=True)
        results = {"model": model.label, "metrics": metrics}
        atomic_write_json(local / EVAL_RESULTS_FILE, results)
        atomic_write_json(local / artifacts.RECORD_FILE, full_record)
        ArtifactFolder.at(local).write_status(artifacts.SUCCESS)  # last
    lines = [f"  {name}: {value:.4f}" for name, value in sorted(metrics.items())]
    return "\n".join([f"kiln: built {record.ref} at {target.location()}", *lines])


def eval_request(
    identity: Mapping[str, Any], validation: tuple[ValidationCache, ...], task_paths: tuple[str, ...]
) -> EvalRequest:
    """What the identity asks to score, with the caches and task folders where they are here."""
    evals = identity.get("evals")
    suite = None
    if evals is not None:
        suite = {k: v for k, v in evals.items() if k != "task_files"}
        suite["task_paths"] = list(task_paths)
        suite.setdefault("every", 1)  # an evaluation scores once: its identity has no cadence
    return EvalRequest(
        suite=suite,
        validation=validation,
        seq_len=identity["seq_len"],
        batch_size=identity["batch_size"],
        max_eval_batches=identity.get("max_eval_batches"),
        compute_dtype=identity["compute_dtype"],
    )


def _scores(
    model: HfModelSource | ParentRun, store: ObjectStore, request: EvalRequest
) -> dict[str, float]:
    if isinstance(model, HfModelSource):
        return evaluate_hf_llama(hf_model_folder(model), request)
    folder = built_parent(store, model)
    if model.kind == "hf_model":
        with folder.local_files() as local:
            return evaluate_hf_llama(local, request)
    with _trained_run(folder, model) as (run, step):
        checkpoint = run.checkpoint(step)
        return evaluate_model(
            run.model_config, lambda: ImportedLlama(run.model_config, run.params(checkpoint)),
            run.tokenizer(), request, where=checkpoint.path,
        )  # fmt: skip


@contextmanager
def _trained_run(folder: ArtifactFolder, model: ParentRun) -> Iterator[tuple[TrainedRun, Any]]:
    step: int | str = model.step if model.step is not None else "last"
    with local_run(folder, step) as path:
        run = TrainedRun.open(path)
        try:
            yield run, step
        except InteropError as e:
            raise InteropError(f"{model.label}: {e}") from None
        finally:
            run.close()
