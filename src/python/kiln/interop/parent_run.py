"""The weights a run starts from when its `init_from` names another artifact of the graph
(`init_from=":parent"`, `from_checkpoint(":parent", step=N)`; kiln_contract.train.ParentRun):
an lm_checkpoint at one of its saved steps, or an hf_model export.

The parent is found by its `name/version` in the run's own artifact store (a directory or a
bucket: a bucket's run is read through a local copy of its files and that one checkpoint, as an
export reads it) and must be built with the fingerprint the run's identity names: a parent
rebuilt under the same version with another config is refused, not silently used. Its
architecture must be the run's `model` (the fields that shape the weights) and, for a
checkpoint, its tokenizer the run's.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator, Mapping
from typing import Any

from kiln.artifacts.folder import ArtifactFolder
from kiln.artifacts.store import ObjectStore
from kiln.data.mixture import StreamPosition
from kiln.interop.errors import InteropError
from kiln.interop.hub import check_architecture
from kiln.interop.llama_weights import Params
from kiln.interop.read import read_hf_config, read_hf_llama
from kiln.interop.trained_run import TrainedRun
from kiln.model.config import LlamaConfig
from kiln.train.checkpoints import CHECKPOINTS_DIR, METADATA_FILE, CheckpointInfo, check_intact
from kiln.train.run_mirror import local_run
from kiln_contract.train import ParentRun


def parent_params(
    store: ObjectStore, parent: ParentRun, model_config: LlamaConfig, tokenizer: Any
) -> Mapping[str, Any]:
    """The parent's weights as the parameter tree of Llama(model_config), float32."""
    folder = built_parent(store, parent)
    if parent.kind == "hf_model":
        with folder.local_files() as local:
            check_architecture(read_hf_config(local), model_config, parent)
            params: Params = read_hf_llama(local, tokenizer=tokenizer).params
            return params
    with _checkpoint_of(folder, parent, model_config, tokenizer) as (run, checkpoint):
        return run.params(checkpoint)


def parent_state(
    store: ObjectStore, parent: ParentRun, fresh: Any, model_config: LlamaConfig, tokenizer: Any
) -> Any:
    """The parent checkpoint's whole train state (weights and Adam's moments) laid out as
    `fresh`, the run's own initial state, with the step and the learning-rate schedule started
    afresh: the run's own warmup and decay apply from its step 0. The parent's optimizer must
    have the run's structure (the same clipping and weight-decay mask)."""
    from kiln.train.step import with_fresh_schedule

    folder = built_parent(store, parent)
    with _checkpoint_of(folder, parent, model_config, tokenizer) as (run, checkpoint):
        try:
            state = run.checkpointer.restore(checkpoint, fresh)
        except Exception as e:  # orbax raises many types; all mean "not this structure"
            raise InteropError(
                f"init_from: the optimizer state of {parent.label} cannot be restored into this "
                f"run's ({(str(e) or repr(e)).splitlines()[0]}): its optimizer's structure "
                "differs (clipping, weight decay); start from its weights alone "
                "(optimizer_state=False)"
            ) from None
        return with_fresh_schedule(state)


@contextlib.contextmanager
def _checkpoint_of(
    folder: ArtifactFolder, parent: ParentRun, model_config: LlamaConfig, tokenizer: Any
) -> Iterator[tuple[TrainedRun, CheckpointInfo]]:
    """The parent run (a local copy of a bucket's) and its checkpoint at the chosen step,
    checked against the run's architecture and tokenizer."""
    step = parent.step if parent.step is not None else "last"
    with local_run(folder, step) as path:
        run = TrainedRun.open(path)
        try:
            check_architecture(run.model_config, model_config, parent)
            _check_tokenizer(run, tokenizer, parent)
            try:
                checkpoint = run.checkpoint(step)
            except InteropError as e:
                raise InteropError(f"init_from: {parent.ref}: {e}") from None
            check_intact(checkpoint)
            yield run, checkpoint
        finally:
            run.close()


def parent_data_position(store: ObjectStore, parent: ParentRun) -> StreamPosition:
    """Where the parent's data stream stood at the step the run starts from: the position its
    checkpoint of that step records (kiln.train.checkpoints' metadata.json)."""
    folder = built_parent(store, parent)
    steps = sorted(
        int(found[1])
        for key in folder.store.keys(folder.child(CHECKPOINTS_DIR))
        if (found := re.fullmatch(rf"step-(\d+)/{METADATA_FILE}", key))
    )
    step = parent.step if parent.step is not None else (steps[-1] if steps else None)
    if step not in steps:
        raise InteropError(
            f"init_from: {parent.ref} has no checkpoint of step {step} in "
            f"{folder.location()} (saved: {', '.join(map(str, steps)) or 'none'})"
        )
    text = folder.text(f"{CHECKPOINTS_DIR}/step-{step}/{METADATA_FILE}")
    recorded = None if text is None else json.loads(text).get("data")
    if recorded is None:
        raise InteropError(
            f"init_from: {parent.ref}'s checkpoint of step {step} records no data position (it "
            "was saved before checkpoints recorded one): rebuild the parent under a new version, "
            "or start this run's data afresh, `reset_data_loader_on_init=True`"
        )
    return StreamPosition.from_json(recorded)


def built_parent(store: ObjectStore, parent: ParentRun) -> ArtifactFolder:
    """The parent's folder, refused unless it holds the parent built with its fingerprint."""
    folder = ArtifactFolder(store, f"{parent.name}/{parent.version}")
    record = folder.record()
    if record is None or not folder.is_built():
        raise InteropError(
            f"init_from: {parent.ref} is not built at {folder.location()} (STATUS "
            f"{folder.status() or 'missing'}); build it first: `pants build` builds a run's "
            "parent before the run"
        )
    if record.get("fingerprint") != parent.fingerprint:
        raise InteropError(
            f"init_from: {folder.location()} holds {parent.ref} with fingerprint "
            f"{record.get('fingerprint')}, not {parent.fingerprint}, the one this run starts "
            "from; rebuild the parent under a new version"
        )
    return folder


def _check_tokenizer(run: TrainedRun, tokenizer: Any, parent: ParentRun) -> None:
    recorded = run.tokenizer_record
    if recorded.get("digest") != tokenizer.digest:
        raise InteropError(
            f"init_from: {parent.ref} was trained with tokenizer {recorded.get('name')!r} "
            f"({recorded.get('vocab_size')} tokens), not this run's {tokenizer.name!r} "
            f"({tokenizer.vocab_size} tokens): a run continues in its parent's vocabulary"
        )
