"""TrainState, train / eval / log-prob steps, checkpointability, and 1 vs 4 devices."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import textwrap

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from kiln.model.config import LlamaConfig
from kiln.train.mesh import make_mesh
from kiln.train.optimizer import AdamConfig, learning_rate_schedule
from kiln.train.step import (
    ModelOptions,
    abstract_train_state,
    init_train_state,
    make_eval_step,
    make_logprob_fn,
    make_train_step,
    shard_batch,
    train_step_fn,
)

MODEL = LlamaConfig(
    max_seq_len=16,
    hidden_dim=64,  # head_dim 16: the smallest the Pallas kernel takes
    intermediate_dim=64,
    num_heads=4,
    num_kv_heads=2,
    num_layers=1,
    vocab_size=64,
)
ADAM = AdamConfig(learning_rate=1e-2, warmup=2)
STEPS = 10
OPTIONS = ModelOptions(compute_dtype="float32", attention="xla")


def make_batch(seed: int, batch_size: int = 4, seq_len: int = 16) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, MODEL.vocab_size, (batch_size, seq_len)).astype(np.int32)
    segment_ids = np.ones_like(tokens)
    segment_ids[:, seq_len // 2 :] = 2  # two packed documents per row
    loss_mask = np.ones(tokens.shape, np.float32)
    loss_mask[:, seq_len // 2 - 1] = 0  # the first document's last token predicts nothing
    loss_mask[:, -1] = 0
    return {"tokens": tokens, "segment_ids": segment_ids, "loss_mask": loss_mask}


@pytest.fixture(scope="module")
def mesh():
    return make_mesh()


@pytest.fixture(scope="module")
def train_step(mesh):
    return make_train_step(ADAM, STEPS, z_loss_weight=1e-4, mesh=mesh)


def new_state(mesh, seed: int = 0):
    return init_train_state(MODEL, ADAM, STEPS, seed=seed, mesh=mesh, options=OPTIONS)


def assert_trees_equal(a, b) -> None:
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(x, y)


def test_same_seed_same_init_and_other_seeds_differ(mesh) -> None:
    assert_trees_equal(new_state(mesh).params, new_state(mesh).params)
    first, other = new_state(mesh).params, new_state(mesh, seed=1).params
    assert not np.array_equal(first["lm_head"]["kernel"][...], other["lm_head"]["kernel"][...])


def test_train_step_is_deterministic_and_learns(mesh, train_step) -> None:
    batch = shard_batch(make_batch(0), mesh)
    state_a, metrics_a = train_step(new_state(mesh), batch)
    state_b, metrics_b = train_step(new_state(mesh), batch)
    assert_trees_equal(state_a, state_b)
    assert {k: float(v) for k, v in metrics_a.items()} == {
        k: float(v) for k, v in metrics_b.items()
    }
    assert set(metrics_a) == {"loss", "cross_entropy", "z_loss", "grad_norm", "learning_rate"}
    assert int(state_a.step) == 1

    losses, state = [float(metrics_a["loss"])], state_a
    schedule = learning_rate_schedule(ADAM, STEPS)
    for step in range(1, 6):
        state, metrics = train_step(state, batch)
        assert float(metrics["learning_rate"]) == pytest.approx(float(schedule(step)))
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0] - 0.5, losses
    assert float(metrics_a["learning_rate"]) == 0.0  # warmup starts at 0


def test_eval_step_and_logprob_fn_agree_with_the_training_loss(mesh, train_step) -> None:
    state, batch = new_state(mesh), make_batch(1)
    sums = make_eval_step(mesh=mesh)(state, shard_batch(batch, mesh))
    assert float(sums["token_count"]) == batch["loss_mask"][:, :-1].sum()

    one_document = {**batch, "segment_ids": np.ones_like(batch["tokens"])}
    log_probs = make_logprob_fn(state.graphdef)(state, batch["tokens"])
    assert log_probs.shape == (4, 15) and log_probs.dtype == np.float32
    # Make tokens[:, 1] the model's choice after tokens[:, 0] (position 0 sees only token 0).
    model = nnx.merge(state.graphdef, state.params)
    greedy = batch["tokens"].copy()
    greedy[:, 1] = np.asarray(model(greedy))[:, 0].argmax(-1)
    _, is_argmax = make_logprob_fn(state.graphdef, with_is_argmax=True)(state.params, greedy)
    assert is_argmax[:, 0].all()
    logits = np.asarray(model(greedy))
    np.testing.assert_array_equal(is_argmax, logits[:, :-1].argmax(-1) == greedy[:, 1:])
    one_doc_sums = make_eval_step(mesh=mesh)(state, shard_batch(one_document, mesh))
    masked = -(log_probs * one_document["loss_mask"][:, :-1]).sum()
    assert float(one_doc_sums["loss_sum"]) == pytest.approx(float(masked), rel=1e-5)

    _, metrics = train_step(state, shard_batch(batch, mesh))
    mean = float(sums["loss_sum"]) / float(sums["token_count"])
    assert float(metrics["cross_entropy"]) == pytest.approx(mean, rel=1e-5)


def test_state_round_trips_through_orbax(mesh, train_step, tmp_path) -> None:
    batch = shard_batch(make_batch(2), mesh)
    state, _ = train_step(new_state(mesh), batch)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "state", state)
    checkpointer.wait_until_finished()
    target = abstract_train_state(MODEL, ADAM, STEPS, mesh=mesh, options=OPTIONS)
    restored = checkpointer.restore(tmp_path / "state", target)
    assert_trees_equal(restored, state)
    assert restored.graphdef == state.graphdef
    _, expected = train_step(state, batch)
    _, actual = train_step(restored, batch)
    assert float(actual["loss"]) == float(expected["loss"])


def test_microbatches_give_the_one_pass_update(mesh) -> None:
    batch = make_batch(3, batch_size=8)
    batch["loss_mask"][1, :12] = 0  # microbatches with unequal token counts: the mean is global
    batch["loss_mask"][6, 3:] = 0
    batch = shard_batch(batch, mesh)
    one_pass, expected = make_train_step(ADAM, STEPS, z_loss_weight=1e-4, mesh=mesh)(
        new_state(mesh), batch
    )
    for microbatches in (2, 4):
        step = make_train_step(
            ADAM, STEPS, z_loss_weight=1e-4, mesh=mesh, microbatches=microbatches
        )
        state, metrics = step(new_state(mesh), batch)
        for name in ("loss", "cross_entropy", "z_loss", "grad_norm", "learning_rate"):
            np.testing.assert_allclose(metrics[name], expected[name], rtol=1e-5, err_msg=name)
        for actual, wanted in zip(jax.tree.leaves(state.params), jax.tree.leaves(one_pass.params)):
            np.testing.assert_allclose(actual, wanted, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="does not split into 3 microbatches"):
        make_train_step(ADAM, STEPS, z_loss_weight=None, mesh=mesh, microbatches=3)(
            new_state(mesh), batch
        )


# In interpret mode each pallas_call is a while loop over its grid, named after the kernel: one
# such loop in the compiled step is one run of the kernel.
FORWARD_KERNEL_LOOP = re.compile(r' while\(.*op_name="[^"]*kiln_flash_attention_fwd/while"')


def compiled_forward_kernel_runs(remat: str, mesh) -> int:
    """How often the compiled bf16 train step (Pallas attention) runs the forward kernel."""
    model = dataclasses.replace(MODEL, num_layers=2)
    options = dataclasses.replace(
        OPTIONS, compute_dtype="bfloat16", attention="pallas", remat=remat
    )
    state = abstract_train_state(model, ADAM, STEPS, mesh=mesh, options=options)
    batch = shard_batch(make_batch(0), mesh)
    step = jax.jit(train_step_fn(ADAM, STEPS, z_loss_weight=1e-4, mesh=mesh), donate_argnums=0)
    with jax.set_mesh(mesh):
        hlo = step.lower(state, batch).compile().as_text()
    return sum(1 for line in hlo.splitlines() if FORWARD_KERNEL_LOOP.search(line))


@pytest.mark.parametrize("remat, runs", [("save_dots", 2), ("offload", 2), ("full", 4)])
def test_the_backward_reruns_the_attention_forward_only_under_full_remat(
    remat: str, runs: int, mesh
) -> None:
    """save_dots and offload keep the kernel's output and log-sum-exp: the 2-layer step runs the
    forward kernel once per layer. `full` recomputes it in the backward (twice per layer)."""
    assert compiled_forward_kernel_runs(remat, mesh) == runs


def test_shard_batch_rejects_bad_batches(mesh) -> None:
    batch = make_batch(0)
    with pytest.raises(ValueError, match=r"missing field\(s\) \['loss_mask'\]"):
        shard_batch({k: v for k, v in batch.items() if k != "loss_mask"}, mesh)
    with pytest.raises(ValueError, match="must all be \\[batch, seq_len\\]"):
        shard_batch({**batch, "loss_mask": batch["loss_mask"][:, :3]}, mesh)


MULTI_DEVICE_SCRIPT = textwrap.dedent(
    """
    import dataclasses, json, sys
    import jax, numpy as np
    from test_step import ADAM, MODEL, OPTIONS, STEPS, make_batch
    from kiln.train.mesh import make_mesh
    from kiln.train.step import init_train_state, make_train_step, shard_batch

    def losses(mesh_config, devices, attention="xla", microbatches=1):
        mesh = make_mesh(mesh_config, devices)
        options = dataclasses.replace(OPTIONS, attention=attention)
        state = init_train_state(MODEL, ADAM, STEPS, seed=0, mesh=mesh, options=options)
        step = make_train_step(
            ADAM, STEPS, z_loss_weight=1e-4, mesh=mesh, microbatches=microbatches
        )
        out = []
        for i in range(5):
            state, metrics = step(state, shard_batch(make_batch(i, batch_size=8), mesh))
            out.append(float(metrics["loss"]))
        specs = {
            "q_proj": str(state.params["blocks"][0]["attention"]["q_proj"]["kernel"].sharding.spec),
            "tokens": str(shard_batch(make_batch(0, batch_size=8), mesh)["tokens"].sharding.spec),
        }
        return {"losses": out, "specs": specs}

    assert jax.device_count() == 4, jax.devices()
    results = {"single": losses({"data": 1}, jax.devices()[:1])}
    results["data=4"] = losses({"data": 4}, None)
    results["data=2,fsdp=2"] = losses({"data": 2, "fsdp": 2}, None)
    results["data=2,fsdp=2,microbatches=2"] = losses({"data": 2, "fsdp": 2}, None, microbatches=2)
    # The Pallas kernel (interpret mode) runs per shard under shard_map.
    results["fsdp=2,tensor=2,pallas"] = losses({"fsdp": 2, "tensor": 2}, None, "pallas")
    try:
        make_mesh({"data": 2})
    except ValueError as error:
        results["error"] = str(error)
    print("RESULT " + json.dumps(results))
    """
)


def test_four_devices_give_the_single_device_losses() -> None:
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), *sys.path]),
    }
    run = subprocess.run(
        [sys.executable, "-c", MULTI_DEVICE_SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    line = next(line for line in run.stdout.splitlines() if line.startswith("RESULT "))
    results = json.loads(line.removeprefix("RESULT "))
    single = np.asarray(results.pop("single")["losses"])
    assert "covers 2 devices, but there are 4" in results.pop("error")
    # fp32 compute: only the order of reductions differs (and the kernel's online softmax).
    for name, result in results.items():
        np.testing.assert_allclose(result["losses"], single, rtol=1e-5, err_msg=name)
    assert results["fsdp=2,tensor=2,pallas"]["specs"]["q_proj"] == "P('fsdp', 'tensor')"
    assert results["data=2,fsdp=2"]["specs"]["tokens"] == "P(('data', 'fsdp'),)"
