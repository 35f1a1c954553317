"""A step made portable: the step spec, the inputs it carries, the local tokenizer folders its
caches name and Kiln's own sources in one folder, for a machine that trains without Pants (a TPU
VM with its own JAX). There the runner runs from the folder as `pants run` runs it here, from the
repository root (docs/training.md, "Training on another machine"): paths that the step, its
caches and its eval tasks give relative to the root resolve in the folder."""

from __future__ import annotations

import shutil
from pathlib import Path

import kiln
import kiln_contract
from kiln.artifacts.locations import open_store
from kiln.data.cache import read_cache_records
from kiln.data.tokenizer import resolve_tokenizer_spec
from kiln.runner.errors import StepError
from kiln.runner.inputs import input_locations
from kiln_contract.location import is_bucket_url
from kiln_contract.step import STEP_FILE, StepSpec

SOURCES = "src"


def write_bundle(step_file: Path, step: StepSpec, inputs: Path, bundle: Path, prefix: str) -> str:
    """Copies what the runner reads into `bundle` and returns the command that trains from it.
    The step is copied as written (run-time overrides are given again where it runs)."""
    _check_portable(step)
    if bundle.exists() and any(bundle.iterdir()):
        raise StepError(f"--bundle {bundle}: the folder is not empty; give a new one")
    staging = bundle.with_name(f".{bundle.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    shutil.copyfile(step_file, staging / STEP_FILE)
    for relative in _carried(step):
        shutil.copytree(inputs / relative, staging / relative, symlinks=False)
    for relative, folder in _local_tokenizers(step, inputs).items():
        shutil.copytree(folder, staging / relative, symlinks=False, dirs_exist_ok=True)
    for package in (kiln, kiln_contract):
        source = Path(str(package.__file__)).parent
        # Sources only: BUILD files would put Kiln's targets twice into a repository that holds
        # the bundle.
        shutil.copytree(source, staging / SOURCES / source.name,
                        ignore=shutil.ignore_patterns("__pycache__", "BUILD", "BUILD.*"))  # fmt: skip
    if bundle.exists():
        bundle.rmdir()
    staging.rename(bundle)  # whole or absent
    return (
        f"cd {bundle} && PYTHONPATH={SOURCES} python -m kiln.runner {STEP_FILE} --inputs . "
        f"--prefix {prefix}"
    )


def _carried(step: StepSpec) -> list[str]:
    """The folders under `--inputs` the step names: inline caches and eval task files."""
    folders = [i.location for i in step.inputs if i.location is not None]
    evals = step.config.evals
    return folders + list(evals.task_paths if evals is not None else ())


def _local_tokenizers(step: StepSpec, inputs: Path) -> dict[str, Path]:
    """The local tokenizer folders the step's caches were tokenized with, named (as cache.json
    records them) relative to the repository root, by that name: the report's samples and the
    evals load the tokenizer, and a folder found here is absent there. A path out of the root
    (absolute, or through `..`) is the other machine's to provide: the bundle writes only below
    its own folder."""
    folders: dict[str, Path] = {}
    for ref, location in input_locations(step, inputs, None).items():
        info, _ = read_cache_records(open_store(location))
        spec = info.get("tokenizer", {}).get("spec")
        if not isinstance(spec, dict) or spec.get("kind") != "local":
            continue
        relative = Path(spec["path"])
        if relative.is_absolute() or ".." in relative.parts or str(relative) in folders:
            continue
        found = Path(resolve_tokenizer_spec(spec, [inputs])["path"])
        if not (found / "tokenizer.json").is_file():
            raise StepError(
                f"--bundle: {ref} was tokenized with the local tokenizer {relative}, which is not "
                f"in {Path.cwd()}; run from the repository root (as `pants run` does)"
            )
        folders[str(relative)] = found
    return folders


def _check_portable(step: StepSpec) -> None:
    for cache in step.inputs:
        if cache.store_path is not None and not is_bucket_url(cache.store_path):
            raise StepError(
                f"--bundle: {cache.ref} is a store cache in this machine's folder "
                f"{cache.store_path}, which another machine cannot read; build with a bucket "
                "prefix (--kiln-prefix=gs://BUCKET/PATH) so both machines read the store"
            )
