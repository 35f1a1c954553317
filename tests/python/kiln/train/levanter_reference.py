"""The reference side of the training-parity test: Levanter's own code (marin-levanter), CPU.

Runs as its own process, from the `levanter-tests` resolve (Levanter pins its own jax, optax and
transformers; none of it enters the runtime), built as a PEX that test_levanter_parity.py runs:
`PEX_MODULE=kiln.train.levanter_reference python levanter.pex JOBS.json`. Parameters cross the process boundary in Kiln's
layout (npz files keyed like `blocks/0/attention/q_proj/kernel`, kernels `[in, out]`); this file
maps them to and from Levanter's `LlamaLMHeadModel` (haliax named arrays, `out_first` weights,
layers stacked for its scan). JOBS.json is a list; each job has a `kind`:

  schedules      {"cases": [{"optimizer": {AdamConfig kwargs}, "num_train_steps": N}], "out"}
                 AdamConfig(...).lr_scheduler(N) at steps 0..N - 1: npz lr_0, lr_1, ...
  init           {"model", "vocab_size", "seed", "out"}  LlamaConfig.build from train_lm's
                 model key (split(PRNGKey(seed), 4)[2]): its parameters
  update         {"model", "vocab_size", "params", "grads": [npz...], "optimizer",
                 "num_train_steps", "out"}  TrainerState.init + take_step once per gradient
  loss_and_grads {"model", "vocab_size", "params", "tokens": npy, "eos_id", "z_loss_weight",
                 "out"}  compute_next_token_loss on LmExample.causal(tokens, eos_id=...) and
                 its gradient: npz loss + the gradient tree
  train          {"model", "vocab_size", "params", "tokens": npy [steps, B, T], "eos_id",
                 "optimizer", "num_train_steps", "z_loss_weight", "out"}  Levanter's Trainer
                 (fp32 policy, no tracker) runs train_step on each batch: npz losses + the final
                 parameters

Every model here uses Levanter's defaults but for the fields Kiln declares (rope theta, norm
epsilon, tied embeddings). It prints one JSON line per job.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import equinox as eqx  # pants: no-infer-dep
import haliax as hax  # pants: no-infer-dep
import jax  # pants: no-infer-dep
import jax.numpy as jnp  # pants: no-infer-dep
import jax.random as jrandom  # pants: no-infer-dep
import numpy as np  # pants: no-infer-dep
from levanter.layers.rotary import DefaultRotaryEmbeddingsConfig
from levanter.models.llama import LlamaConfig, LlamaLMHeadModel
from levanter.models.lm_model import LmExample
from levanter.optim.config import AdamConfig
from levanter.trainer_state import TrainerState

Getter = Callable[[LlamaLMHeadModel], Any]


def levanter_config(model: dict[str, Any]) -> LlamaConfig:
    return LlamaConfig(
        max_seq_len=model["max_seq_len"],
        hidden_dim=model["hidden_dim"],
        intermediate_dim=model["intermediate_dim"],
        num_layers=model["num_layers"],
        num_heads=model["num_heads"],
        num_kv_heads=model["num_kv_heads"],
        layer_norm_epsilon=model.get("norm_eps", 1e-5),
        tie_word_embeddings=model.get("tie_embeddings", False),
        rope=DefaultRotaryEmbeddingsConfig(theta=model.get("rope_theta", 500000.0)),
    )


def build_model(job: dict[str, Any], seed: int = 0) -> LlamaLMHeadModel:
    model_key = jrandom.split(jrandom.PRNGKey(seed), 4)[2]  # train_lm's model key
    vocab = hax.Axis("vocab", job["vocab_size"])
    return eqx.filter_jit(levanter_config(job["model"]).build)(vocab, key=model_key)


def parameter_table(config: LlamaConfig) -> list[tuple[str, Getter, int | None]]:
    """(Kiln path with {i} for the layer, Levanter getter, fan-in of a linear weight or None)."""
    d, heads = config.hidden_dim, config.num_heads * config.actual_head_size

    def layers(m: LlamaLMHeadModel) -> Any:
        return m.transformer.layers.stacked

    table: list[tuple[str, Getter, int | None]] = [
        ("blocks/{i}/attention_norm/scale", lambda m: layers(m).input_layernorm.weight, None),
        ("blocks/{i}/mlp_norm/scale", lambda m: layers(m).post_attention_layernorm.weight, None),
        ("blocks/{i}/attention/q_proj/kernel", lambda m: layers(m).self_attn.q_proj.weight, d),
        ("blocks/{i}/attention/k_proj/kernel", lambda m: layers(m).self_attn.k_proj.weight, d),
        ("blocks/{i}/attention/v_proj/kernel", lambda m: layers(m).self_attn.v_proj.weight, d),
        ("blocks/{i}/attention/o_proj/kernel", lambda m: layers(m).self_attn.o_proj.weight, heads),
        ("blocks/{i}/mlp/gate_proj/kernel", lambda m: layers(m).mlp.gate_proj.weight, d),
        ("blocks/{i}/mlp/up_proj/kernel", lambda m: layers(m).mlp.up_proj.weight, d),
        ("blocks/{i}/mlp/down_proj/kernel",
         lambda m: layers(m).mlp.down_proj.weight, config.intermediate_dim),
        ("embed/embedding", lambda m: m.embeddings.token_embeddings.weight, None),
        ("final_norm/scale", lambda m: m.transformer.norm.weight, None),
    ]  # fmt: skip
    if not config.tie_word_embeddings:
        table.append(("lm_head/kernel", lambda m: m.lm_head.weight, d))
    return table


def to_kiln(value: np.ndarray, fan_in: int | None) -> np.ndarray:
    """A Levanter weight (out_first: [out..., in...]) as Kiln's [in, out] kernel."""
    return value if fan_in is None else value.reshape(-1, fan_in).T


def from_kiln(value: np.ndarray, fan_in: int | None, shape: tuple[int, ...]) -> np.ndarray:
    return value if fan_in is None else value.T.reshape(shape)


def kiln_layout(tree: LlamaLMHeadModel) -> dict[str, np.ndarray]:
    """The model's (or a gradient's) arrays under Kiln's parameter paths."""
    out = {}
    for path, get, fan_in in parameter_table(tree.config):
        value = np.asarray(get(tree).array, np.float32)
        if "{i}" in path:
            for i in range(tree.config.num_layers):
                out[path.format(i=i)] = to_kiln(value[i], fan_in)
        else:
            out[path] = to_kiln(value, fan_in)
    return out


def with_kiln_layout(model: LlamaLMHeadModel, arrays: Any) -> LlamaLMHeadModel:
    """`model` with every array replaced by the Kiln-layout one of the same parameter."""
    for path, get, fan_in in parameter_table(model.config):
        old = get(model)
        if "{i}" in path:
            layer_shape = old.array.shape[1:]
            value = np.stack([
                from_kiln(arrays[path.format(i=i)], fan_in, layer_shape)
                for i in range(model.config.num_layers)
            ])  # fmt: skip
        else:
            value = from_kiln(arrays[path], fan_in, old.array.shape)
        new = hax.named(jnp.asarray(value, old.array.dtype), old.axes)
        model = eqx.tree_at(get, model, new)
    return model


def examples(tokens: np.ndarray, eos_id: int) -> LmExample:
    """Levanter's training examples for [B, T] tokens: the causal mask, documents split after
    each EOS (block_cross_document_attention), every position but the last counted."""
    batch = hax.named(jnp.asarray(tokens, jnp.int32), ("batch", "position"))
    return _examples(batch, eos_id)


@eqx.filter_jit
def _examples(batch: Any, eos_id: int) -> LmExample:
    return hax.vmap(lambda t: LmExample.causal(t, eos_id=eos_id), "batch")(batch)


def schedules(job: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for i, case in enumerate(job["cases"]):
        steps = case["num_train_steps"]
        schedule = AdamConfig(**case["optimizer"]).lr_scheduler(steps)
        out[f"lr_{i}"] = np.asarray(jax.vmap(schedule)(jnp.arange(steps)), np.float64)
    np.savez(job["out"], **out)
    return {"cases": len(job["cases"])}


def init(job: dict[str, Any]) -> dict[str, Any]:
    model = build_model(job, seed=job["seed"])
    np.savez(job["out"], **kiln_layout(model))
    return {"parameters": len(jax.tree.leaves(model))}


def update(job: dict[str, Any]) -> dict[str, Any]:
    model = with_kiln_layout(build_model(job), np.load(job["params"]))
    optimizer = AdamConfig(**job["optimizer"]).build(job["num_train_steps"])
    state = TrainerState.init(optimizer, model, key=jrandom.PRNGKey(0))
    for grads_file in job["grads"]:
        grads = with_kiln_layout(model, np.load(grads_file))
        state, _ = state.take_step(grads, key=jrandom.PRNGKey(0))
    np.savez(job["out"], **kiln_layout(state.model))
    return {"updates": len(job["grads"])}


def loss_and_grads(job: dict[str, Any]) -> dict[str, Any]:
    model = with_kiln_layout(build_model(job), np.load(job["params"]))
    example = examples(np.load(job["tokens"]), job["eos_id"])

    def loss(m: LlamaLMHeadModel) -> jax.Array:
        value = m.compute_next_token_loss(example, logsumexp_weight=job["z_loss_weight"])
        return value.scalar()

    value, grads = eqx.filter_jit(eqx.filter_value_and_grad(loss))(model)
    np.savez(job["out"], loss=np.float64(value), **kiln_layout(grads))
    return {"loss": float(value)}


def train(job: dict[str, Any]) -> dict[str, Any]:
    from levanter.checkpoint import CheckpointerConfig
    from levanter.tracker import NoopConfig
    from levanter.trainer import Trainer, TrainerConfig

    tokens = np.load(job["tokens"])
    steps, batch_size = tokens.shape[:2]
    config = TrainerConfig(
        num_train_steps=job["num_train_steps"],
        train_batch_size=batch_size,
        tracker=NoopConfig(),
        require_accelerator=False,
        log_jaxprs=False,
        log_xla_hlo=False,
        load_checkpoint=False,
        id="kiln-parity",
        log_dir=Path(tempfile.mkdtemp()),
        checkpointer=CheckpointerConfig(base_path=tempfile.mkdtemp(), save_interval=None, keep=None),
    )
    optimizer = AdamConfig(**job["optimizer"]).build(job["num_train_steps"])

    def loss_function(model: LlamaLMHeadModel, example: LmExample, *, key: Any = None) -> Any:
        return model.compute_next_token_loss(
            example, key=key, logsumexp_weight=job["z_loss_weight"]
        )

    losses = []
    with Trainer(config, optimizer, loss_function) as trainer:
        model = with_kiln_layout(build_model(job), np.load(job["params"]))
        state = trainer.initial_state(jrandom.PRNGKey(0), model=model)
        for step in range(steps):
            info = trainer.train_step(state, examples(tokens[step], job["eos_id"]))
            losses.append(info.loss)
            state = info.state
    np.savez(job["out"], losses=np.asarray(losses, np.float64), **kiln_layout(state.model))
    return {"steps": steps, "last_loss": losses[-1]}


JOBS = {
    "schedules": schedules,
    "init": init,
    "update": update,
    "loss_and_grads": loss_and_grads,
    "train": train,
}


def main(jobs_file: str) -> None:
    with open(jobs_file) as f:
        jobs = json.load(f)
    for job in jobs:
        started = time.monotonic()
        report = JOBS[job["kind"]](job)
        seconds = round(time.monotonic() - started, 2)
        print(json.dumps({"kind": job["kind"], **report, "seconds": seconds}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
