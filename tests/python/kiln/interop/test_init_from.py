"""`init_from=hf_model_source(...)`: a run starts from published Llama weights.

The weights are "published" the way huggingface_hub caches a download (`HF_HOME/hub/models--ORG--
NAME/snapshots/COMMIT/`), written by Kiln's own export; with `HF_HUB_OFFLINE=1` the real
`snapshot_download` serves them from there, so nothing reaches the hub.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from flax import nnx
from kiln_testing.data import STDLIB_TOKENIZER
from kiln_testing.training import EXAMPLE_SPEC, build_tiny_cache, make_spec, write_runner_step

from kiln.data.tokenizer import load_tokenizer
from kiln.interop.errors import InteropError
from kiln.interop.export import write_hf_llama
from kiln.interop.hub import check_architecture, hf_model_folder
from kiln.interop.read import read_hf_llama
from kiln.model.config import LlamaConfig
from kiln.model.llama import Llama
from kiln.train.errors import TrainingError
from kiln.train.setup import RunStart, TrainerSetup
from kiln.train.spec import parse_spec
from kiln.train.step import with_params
from kiln.train.trainer import train
from kiln_contract.llama import LlamaArchitecture
from kiln_contract.train import HfModelSource, ParentRun

SOURCE = HfModelSource("kiln-test/tiny-llama", revision="0123456789abcdef" * 2 + "01234567")
INIT_FROM = SOURCE.to_json()
ARCHITECTURE = LlamaArchitecture.from_json(EXAMPLE_SPEC["config"]["model"], "model")


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer(STDLIB_TOKENIZER)


def published(hf_home: Path, tokenizer: Any, config: LlamaConfig | None = None) -> Path:
    """Random weights for the example run's model, in the hub cache's layout; their folder."""
    config = config or LlamaConfig.for_vocabulary(ARCHITECTURE, tokenizer.info.vocab_size)
    shapes = nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0)))))
    rng = np.random.default_rng(3)
    params = jax.tree.map(lambda leaf: rng.standard_normal(leaf.shape, np.float32), shapes)
    repo = hf_home / "hub" / ("models--" + SOURCE.model.replace("/", "--"))
    return write_hf_llama(repo / "snapshots" / SOURCE.revision, config, params, tokenizer)


def leaves(tree: Any) -> dict[str, np.ndarray]:
    return {jax.tree_util.keystr(p): np.asarray(v) for p, v in jax.tree_util.tree_leaves_with_path(tree)}


def test_a_fresh_run_starts_from_the_weights_and_a_resumed_one_from_its_checkpoint(
    tokenizer: Any, tmp_path: Path
) -> None:
    folder = published(tmp_path / "hf", tokenizer)
    caches = {n: build_tiny_cache(tmp_path, n, 40, seed=i) for i, n in enumerate(("a", "val"))}
    spec = parse_spec(make_spec(
        tmp_path / "run", {"a": caches["a"]}, {"val": caches["val"]},
        **{"config.init_from": INIT_FROM, "config.num_train_steps": 4},
    ))  # fmt: skip
    loads: list[HfModelSource] = []

    def weights(source: HfModelSource, fresh: Any, config: LlamaConfig, tok: Any) -> Any:
        loads.append(source)
        return with_params(fresh, read_hf_llama(folder, tokenizer=tok).params)

    start = TrainerSetup(spec, RunStart(weights)).initial_state()
    assert start.step == 0 and start.checkpoint is None and loads == [SOURCE]
    expected = leaves(read_hf_llama(folder).params)
    started = leaves(nnx.to_pure_dict(start.state.params))
    assert started.keys() == expected.keys()
    for name, value in expected.items():
        assert np.array_equal(started[name], value), name  # float32: bit for bit

    train(spec, start=RunStart(weights))
    resumed = TrainerSetup(spec, RunStart(weights)).initial_state()
    assert resumed.step == 4 and loads == [SOURCE, SOURCE]  # the resumed run read no weights


def test_a_run_without_the_runner_is_refused(tmp_path: Path) -> None:
    cache = build_tiny_cache(tmp_path, "a", 20, seed=0)
    spec = parse_spec(make_spec(tmp_path / "run", {"a": cache}, {}, **{"config.init_from": INIT_FROM}))
    with pytest.raises(TrainingError, match="init_from needs the weights loaded by kiln.runner"):
        TrainerSetup(spec)


def test_other_architectures_are_refused_naming_each_field(tokenizer: Any) -> None:
    declared = LlamaConfig.for_vocabulary(ARCHITECTURE, 8192)
    weights = LlamaConfig.for_vocabulary(
        LlamaArchitecture.from_json({**ARCHITECTURE.to_json(), "num_layers": 3,
                                     "max_seq_len": 128, "init_std": 0.01}, "model"), 8192
    )  # fmt: skip
    with pytest.raises(InteropError) as e:
        check_architecture(weights, declared, SOURCE)
    assert "num_layers: model=2, weights=3" in str(e.value)
    assert "max_seq_len" not in str(e.value) and "init_std" not in str(e.value)


def test_a_local_folder_is_read_where_it_is(tokenizer: Any, tmp_path: Path) -> None:
    folder = published(tmp_path / "hf", tokenizer)
    assert hf_model_folder(HfModelSource(str(folder))) == folder
    with pytest.raises(InteropError, match=f"init_from: {tmp_path}/none is not a folder"):
        hf_model_folder(HfModelSource(str(tmp_path / "none")))


def run_runner(root: Path, step: Path, hf_home: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "kiln.runner", str(step), "--inputs", str(root),
         "--prefix", str(root / "store")],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip


def test_the_runner_reads_the_weights_from_the_hugging_face_cache(
    tokenizer: Any, tmp_path: Path
) -> None:
    hf_home = tmp_path / "hf"
    step = write_runner_step(
        tmp_path, **{"config.init_from": INIT_FROM, "config.num_train_steps": 4}
    )
    missing = run_runner(tmp_path, step, hf_home)  # nothing published yet
    assert missing.returncode == 1, missing.stderr
    assert (
        f"init_from: {SOURCE.label} is not in the Hugging Face cache "
        f"({hf_home / 'hub'}) and the hub cannot be reached (HF_HUB_OFFLINE=1)"
    ) in missing.stderr

    published(hf_home, tokenizer)
    started = run_runner(tmp_path, step, hf_home)
    assert started.returncode == 0, started.stderr
    assert f"started from {SOURCE.label}" in started.stdout + started.stderr
    record = json.loads((tmp_path / "store/checkpoints/tiny/2026.11.29/artifact.json").read_text())
    assert record["identity"]["config"]["init_from"] == INIT_FROM
    assert "HF_HOME" not in json.dumps(record)


# --- a run that starts from another run of the graph (init_from=":parent") ---------------------


def child_step(parent_step: Path, folder: Path, init_from: dict[str, Any], **overrides: Any) -> Path:
    """The parent's step as another artifact (`checkpoints/child`) starting from `init_from`."""
    step = json.loads(parent_step.read_text())
    fingerprint = "c0ffee42"
    step.update(name="checkpoints/child", fingerprint=fingerprint)
    step["record"].update(name="checkpoints/child", fingerprint=fingerprint)
    step["config"]["init_from"] = init_from
    for dotted, value in overrides.items():
        section, key = dotted.split(".", 1)
        step[section][key] = value
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "child.json"
    path.write_text(json.dumps(step))
    return path


def eval_losses(run: Path) -> dict[int, float]:
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["eval/loss"] for r in lines if "eval/loss" in r}


def test_a_run_starts_from_a_saved_step_of_its_parent_in_the_store(tmp_path: Path) -> None:
    parent_step = write_runner_step(
        tmp_path, **{"config.num_train_steps": 6, "runtime.checkpointer.every": 3,
                     "runtime.validation_every": 3}
    )  # fmt: skip
    store = tmp_path / "store"
    fingerprint = json.loads(parent_step.read_text())["fingerprint"]
    parent = {"kind": "lm_checkpoint", "name": "checkpoints/tiny", "version": "2026.11.29",
              "fingerprint": fingerprint, "step": 3}  # fmt: skip
    step = child_step(parent_step, tmp_path / "child", parent,
                      **{"runtime.validate_at_start": True})  # fmt: skip

    unbuilt = run_runner(tmp_path, step, tmp_path / "hf")
    assert unbuilt.returncode == 1, unbuilt.stderr
    assert (
        f"init_from: checkpoints/tiny@2026.11.29 is not built at {store}/checkpoints/tiny/"
        "2026.11.29 (STATUS missing); build it first"
    ) in unbuilt.stderr

    assert run_runner(tmp_path, parent_step, tmp_path / "hf").returncode == 0
    started = run_runner(tmp_path, step, tmp_path / "hf")
    assert started.returncode == 0, started.stderr
    assert "started from checkpoints/tiny@2026.11.29 step 3" in started.stdout + started.stderr
    # The child's model at its step 0 is the parent's at step 3: the same validation loss.
    parent_run = store / "checkpoints/tiny/2026.11.29"
    child_run = store / "checkpoints/child/2026.11.29"
    assert eval_losses(child_run)[0] == eval_losses(parent_run)[3]
    assert json.loads((child_run / "train_spec.json").read_text())["config"]["init_from"] == parent

    stale = child_step(parent_step, tmp_path / "stale", {**parent, "fingerprint": "0ther"})
    shutil.rmtree(child_run)
    refused = run_runner(tmp_path, stale, tmp_path / "hf")
    assert refused.returncode == 1
    assert f"holds checkpoints/tiny@2026.11.29 with fingerprint {fingerprint}, not 0ther" in (
        refused.stderr
    )


def test_a_kiln_run_folder_given_as_published_weights_says_to_use_its_address(
    tmp_path: Path,
) -> None:
    (tmp_path / "artifact.json").write_text(
        json.dumps({"kind": "lm_checkpoint", "name": "checkpoints/a", "version": "2026.12.02"})
    )
    with pytest.raises(InteropError, match=r"is a Kiln lm_checkpoint's folder \(checkpoints/a@"
                       r"2026.12.02\), not a transformers model: start from it by its target's "
                       r"address, `init_from=':target'`"):  # fmt: skip
        hf_model_folder(HfModelSource(str(tmp_path)))


def test_the_optimizer_state_comes_along_on_request_with_a_fresh_schedule(tmp_path: Path) -> None:
    """from_checkpoint(..., optimizer_state=True): the parent's weights and Adam moments at the
    step, laid out as the run's own state, at step 0 with the schedule's count at 0."""
    from kiln.artifacts.local import LocalStore
    from kiln.data.cache import open_caches, shared_tokenizer
    from kiln.interop.parent_run import parent_state
    from kiln.interop.trained_run import TrainedRun
    from kiln.train.mesh import make_mesh
    from kiln.train.step import ModelOptions, init_train_state

    parent_step = write_runner_step(tmp_path, **{"config.num_train_steps": 4,
                                                 "runtime.checkpointer.every": 2})  # fmt: skip
    assert run_runner(tmp_path, parent_step, tmp_path / "hf").returncode == 0
    store = LocalStore(tmp_path / "store")
    fingerprint = json.loads(parent_step.read_text())["fingerprint"]
    parent = ParentRun("lm_checkpoint", "checkpoints/tiny", "2026.11.29", fingerprint, step=2,
                       optimizer_state=True)  # fmt: skip
    run = TrainedRun.open(tmp_path / "store/checkpoints/tiny/2026.11.29")
    config, cfg = run.model_config, run.spec.config
    tokenizer = shared_tokenizer(cfg.datasets, open_caches(cfg.datasets))
    fresh = init_train_state(config, cfg.optimizer, cfg.num_train_steps, seed=5, mesh=make_mesh({"data": -1}),
                             options=ModelOptions(compute_dtype="float32"))  # fmt: skip
    started = parent_state(store, parent, fresh, config, tokenizer)
    saved = run.checkpointer.restore(run.checkpoint(2), fresh)
    assert int(started.step) == 0 and int(saved.step) == 2
    for ours, theirs in zip(jax.tree.leaves(started.params), jax.tree.leaves(saved.params)):
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))
    adam = [s for s in jax.tree.leaves(started.opt_state, is_leaf=_is_adam) if _is_adam(s)]
    saved_adam = [s for s in jax.tree.leaves(saved.opt_state, is_leaf=_is_adam) if _is_adam(s)]
    assert int(adam[0].count) == int(saved_adam[0].count) == 2  # bias correction kept
    for ours, theirs in zip(jax.tree.leaves(adam[0].mu), jax.tree.leaves(saved_adam[0].mu)):
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))
    schedules = [s for s in jax.tree.leaves(started.opt_state, is_leaf=_is_schedule)
                 if _is_schedule(s)]  # fmt: skip
    assert schedules and all(int(s.count) == 0 for s in schedules)
    run.close()


def _is_adam(node: Any) -> bool:
    import optax

    return isinstance(node, optax.ScaleByAdamState)


def _is_schedule(node: Any) -> bool:
    import optax

    return isinstance(node, optax.ScaleByScheduleState)
