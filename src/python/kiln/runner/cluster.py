"""A step submitted to a Ray cluster (kiln.cluster): served or refused here, its inputs placed in
the artifact store here, and the training run as a job on the cluster's hosts, each host running
this runner as one process of a multi-host run."""

from __future__ import annotations

import json
from pathlib import Path

from kiln.artifacts.folder import ArtifactFolder
from kiln.artifacts.store import ObjectStore
from kiln.cluster import dispatch, jobs
from kiln.cluster.placement import describe
from kiln.runner.decision import serve_if_built
from kiln.runner.inputs import built_inputs, place_inputs
from kiln_contract.step import StepSpec


def submit(
    step: StepSpec,
    inputs_root: Path,
    store: ObjectStore,
    address: str,
    max_retries: int,
    *,
    detach: bool = False,
    force: bool = False,
) -> int:
    """Serves or refuses here as `run_step` does; otherwise places the inputs in the store and
    submits the training as a job on the cluster's hosts, following it unless `detach`.
    `force` is carried out by the job's process 0, under the artifact's lease."""
    store.check()
    folder = ArtifactFolder(store, f"{step.name}/{step.version}")
    if not force and serve_if_built(step, folder):
        return 0
    resources = step.runtime.resources

    def prepare() -> None:  # once the cluster is reached and can hold the request
        place_inputs(step, inputs_root, store)
        where = f"the Ray cluster at {address}: {describe(resources)}"
        print(f"kiln: training {step.ref} on {where}", flush=True)

    files = {
        dispatch.STEP_FILE: json.dumps(step.to_json()).encode(),
        **_task_files(step, inputs_root),
        **_tokenizer_files(step, inputs_root),
    }
    job = dispatch.ClusterJob(
        job_id=jobs.new_job_id(step.name),
        artifact=step.ref,
        address=address,
        resources=resources,
        files=files,
        prefix=store.location(""),
        max_retries=max_retries,
        force=force,
    )
    return jobs.run(job, prepare, detach=detach, outcome=lambda: _status_line(folder))


def _status_line(folder: ArtifactFolder) -> str:
    """`STATUS SUCCESS at s3://...`: what the job left in the artifact's folder."""
    return f"STATUS {folder.status() or 'none'} at {folder.location()}"


def _task_files(step: StepSpec, inputs_root: Path) -> dict[str, bytes]:
    """The local eval task files the step names, by path under `inputs_root`: they travel to
    the hosts with the step."""
    task_paths = step.config.evals.task_paths if step.config.evals else ()
    return {
        str(path.relative_to(inputs_root)): path.read_bytes()
        for folder in task_paths
        for path in sorted((inputs_root / folder).rglob("*"))
        if path.is_file()
    }


def _tokenizer_files(step: StepSpec, inputs_root: Path) -> dict[str, bytes]:
    """The repository's tokenizer folders that the step's caches name by a relative path (the
    trainer loads them for evals and samples, from the folder it runs in): they travel to the
    hosts at those paths."""
    from kiln.data.cache import read_cache_records

    folders = set()
    for cache in built_inputs(step, inputs_root).values():
        info, _ = read_cache_records(cache)
        spec = info["tokenizer"].get("spec") or {}
        if spec.get("kind") == "local" and not Path(spec["path"]).is_absolute():
            folders.add(Path(spec["path"]))
    return {
        str(folder / path.relative_to(Path.cwd() / folder)): path.read_bytes()
        for folder in sorted(folders)
        for path in sorted((Path.cwd() / folder).rglob("*"))
        if path.is_file()
    }
