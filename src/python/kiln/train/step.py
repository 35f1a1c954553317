"""The jitted training math: TrainState, init, train / eval / log-prob steps, batch placement.

The model is split once (nnx.split) into a static graphdef and a params State; every step is a
plain jax.jit function that nnx.merge's them back inside. See docs/model.md ("Train step").
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from kiln.model.config import LlamaConfig
from kiln.model.levanter_init import levanter_parameters
from kiln.model.llama import Llama
from kiln.model.partitioning import BATCH_AXES
from kiln.train.loss import batch_loss_tokens, next_token_loss, token_losses
from kiln.train.mesh import batch_parallelism, batch_sharding, state_shardings
from kiln.train.optimizer import AdamConfig, build_optimizer, learning_rate_schedule

BATCH_FIELDS = {"tokens": np.int32, "segment_ids": np.int32, "loss_mask": np.float32}
# A batch without segment ids holds one sequence per row (the attention-only benchmark layout).
OPTIONAL_BATCH_FIELDS = ("segment_ids",)
# jax.named_scope()s of the step's parts, so that a profile can attribute its time (the model
# names its attention: kiln.model.attention.ATTENTION_SCOPE).
LOSS_SCOPE = "kiln_lm_head_loss"
OPTIMIZER_SCOPE = "kiln_optimizer"


@struct.dataclass
class TrainState:
    """Arrays plus the static model structure: what a checkpoint saves (graphdef is not saved)."""

    graphdef: nnx.GraphDef = struct.field(pytree_node=False)
    params: nnx.State
    opt_state: optax.OptState
    step: jax.Array  # int32 scalar: optimizer steps taken


@dataclasses.dataclass(frozen=True)
class ModelOptions:
    """How the state's Llama computes, beside what it is (LlamaConfig): its keyword options."""

    compute_dtype: str | jnp.dtype = "bfloat16"
    param_dtype: str | jnp.dtype = "float32"
    attention: str = "auto"
    remat: str = "none"

    def __post_init__(self) -> None:
        # As dtypes: "float32" and jnp.float32 are one option (one cached initializer, not two).
        object.__setattr__(self, "compute_dtype", jnp.dtype(self.compute_dtype))
        object.__setattr__(self, "param_dtype", jnp.dtype(self.param_dtype))

    def llama_kwargs(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def init_train_state(
    model_config: LlamaConfig,
    adam_config: AdamConfig,
    num_train_steps: int,
    *,
    seed: int,
    mesh: Mesh,
    options: ModelOptions,
) -> TrainState:
    """A fresh state, created directly in its sharded layout on `mesh` (same seed, same values)."""
    init = _sharded_initializer(model_config, adam_config, num_train_steps, options, mesh)
    with jax.set_mesh(mesh):
        return init(jax.random.key(seed))


def with_params(state: TrainState, params: Mapping[str, Any]) -> TrainState:
    """`state` with its parameters replaced by `params` (the tree nnx.to_pure_dict gives, e.g.
    imported weights), each laid out as the parameter it replaces: same dtype, same sharding.
    The optimizer state stays as initialised: Adam's moments start at zero whatever the
    parameters are. Every process passes the same full values (multi-host too)."""

    def place(new: Any, old: jax.Array) -> jax.Array:
        value = np.asarray(new, dtype=old.dtype)
        if value.shape != old.shape:
            raise ValueError(f"a parameter of shape {value.shape} replaces one of {old.shape}")
        return jax.make_array_from_callback(old.shape, old.sharding, lambda index: value[index])

    placed = jax.tree.map(place, dict(params), nnx.to_pure_dict(state.params))
    new_params = jax.tree.map(lambda leaf: leaf, state.params)  # a copy to fill in
    nnx.replace_by_pure_dict(new_params, placed)
    return dataclasses.replace(state, params=new_params)


def with_fresh_schedule(state: TrainState) -> TrainState:
    """`state` at step 0 with its learning-rate schedule's count at 0 (a run continuing another
    run's weights and Adam moments on a schedule of its own); Adam's own count, its bias
    correction, stays with the moments it corrects."""

    def restart(node: Any) -> Any:
        if isinstance(node, optax.ScaleByScheduleState):
            return node._replace(count=node.count * 0)  # keeps the count's sharding
        return node

    opt_state = jax.tree.map(
        restart, state.opt_state, is_leaf=lambda n: isinstance(n, optax.ScaleByScheduleState)
    )
    return dataclasses.replace(state, opt_state=opt_state, step=state.step * 0)


def abstract_train_state(
    model_config: LlamaConfig, adam_config: AdamConfig, num_train_steps: int, *, mesh: Mesh,
    options: ModelOptions,
) -> TrainState:  # fmt: skip
    """init_train_state's result as jax.ShapeDtypeStructs with shardings: an orbax restore target."""
    init = _initializer(model_config, adam_config, num_train_steps, options)
    abstract = jax.eval_shape(init, jax.random.key(0))
    return jax.tree.map(
        lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
        abstract,
        state_shardings(abstract, mesh),
    )


def make_train_step(
    adam_config: AdamConfig,
    num_train_steps: int,
    *,
    z_loss_weight: float | None,
    mesh: Mesh,
    microbatches: int = 1,
) -> Callable[[TrainState, Mapping[str, Any]], tuple[TrainState, dict[str, jax.Array]]]:
    """fn(state, batch) -> (next state, {loss, cross_entropy, z_loss, grad_norm, learning_rate}).

    The input state is donated: use only the returned one. learning_rate is the rate applied in
    this step; grad_norm is the global norm before clipping. microbatches > 1 accumulates the
    gradient over that many slices of the batch (one slice's activations in memory at a time):
    the same update as one pass, up to float summation order.
    """
    jitted = jit_train_step(
        adam_config, num_train_steps, z_loss_weight=z_loss_weight, mesh=mesh,
        microbatches=microbatches,
    )  # fmt: skip
    return _under_mesh(jitted, mesh)


def jit_train_step(
    adam_config: AdamConfig,
    num_train_steps: int,
    *,
    z_loss_weight: float | None,
    mesh: Mesh,
    microbatches: int = 1,
) -> Any:
    """The step as training jits it (the state donated), before make_train_step runs it under
    `mesh`: what kiln.fit lowers and compiles ahead of time for a TPU slice, inside
    jax.set_mesh(mesh)."""
    step = train_step_fn(
        adam_config, num_train_steps, z_loss_weight=z_loss_weight, mesh=mesh,
        microbatches=microbatches,
    )  # fmt: skip
    return jax.jit(step, donate_argnums=0)


def train_step_fn(
    adam_config: AdamConfig,
    num_train_steps: int,
    *,
    z_loss_weight: float | None,
    mesh: Mesh | None,
    microbatches: int = 1,
) -> Callable[[TrainState, Mapping[str, Any]], tuple[TrainState, dict[str, jax.Array]]]:
    """make_train_step's function before jit, for jax.export. With a mesh, the next state is
    constrained to the state's shardings."""
    optimizer = build_optimizer(adam_config, num_train_steps)
    schedule = learning_rate_schedule(adam_config, num_train_steps)
    gradients = gradients_fn(z_loss_weight=z_loss_weight, mesh=mesh, microbatches=microbatches)

    def train_step(state: TrainState, batch: Mapping[str, jax.Array]):
        (loss, metrics), grads = gradients(state, batch)
        with jax.named_scope(OPTIMIZER_SCOPE):
            updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
            next_state = dataclasses.replace(
                state,
                params=optax.apply_updates(state.params, updates),
                opt_state=opt_state,
                step=state.step + 1,
            )
        if mesh is not None:
            # Pin the layout so the next call sees the same input shardings (no recompiles).
            next_state = jax.lax.with_sharding_constraint(
                next_state, state_shardings(next_state, mesh)
            )
        metrics = {
            "loss": loss,
            **metrics,
            "grad_norm": optax.tree.norm(grads),
            "learning_rate": schedule(state.step),
        }
        return next_state, metrics

    return train_step


def gradients_fn(
    *, z_loss_weight: float | None, mesh: Mesh | None, microbatches: int = 1
) -> Callable[[TrainState, Mapping[str, jax.Array]], Any]:
    """fn(state, batch) -> ((loss, metrics), grads): the train step's loss and its gradient with
    respect to state.params, before the optimizer (un-jitted; trace it under the mesh)."""

    def gradients(state: TrainState, batch: Mapping[str, jax.Array]) -> Any:
        num_tokens = batch_loss_tokens(batch["loss_mask"])

        def loss_fn(params: nnx.State, micro: Mapping[str, jax.Array]):
            model = nnx.merge(state.graphdef, params)
            hidden = model.hidden_states(micro["tokens"], micro.get("segment_ids"))
            with jax.named_scope(LOSS_SCOPE):
                return next_token_loss(
                    hidden, model.output_weights(), micro["tokens"], micro["loss_mask"],
                    z_loss_weight, num_tokens,
                )  # fmt: skip

        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        if microbatches == 1:
            return grad_fn(state.params, batch)
        split = split_microbatches(batch, microbatches, mesh)
        return _accumulate(grad_fn, state.params, split, mesh)

    return gradients


def split_microbatches(
    batch: Mapping[str, jax.Array], microbatches: int, mesh: Mesh | None
) -> dict[str, jax.Array]:
    """[B, ...] fields -> [microbatches, B / microbatches, ...]. Microbatch i takes rows i,
    i + microbatches, ...: a split of each device's own rows, so no data moves between devices."""

    def split(x: jax.Array) -> jax.Array:
        rows = x.shape[0]
        if rows % microbatches:
            raise ValueError(f"batch of {rows} rows does not split into {microbatches} microbatches")
        x = x.reshape(rows // microbatches, microbatches, *x.shape[1:]).swapaxes(0, 1)
        if mesh is None:
            return x
        return jax.lax.with_sharding_constraint(
            x, NamedSharding(mesh, PartitionSpec(None, BATCH_AXES))
        )

    return {name: split(x) for name, x in batch.items()}


def _accumulate(
    grad_fn: Callable, params: nnx.State, split: Mapping[str, jax.Array], mesh: Mesh | None
) -> Any:
    """Sums grad_fn(params, microbatch) = ((loss, metrics), grads) over the leading axis."""

    def add(total: Any, micro: Mapping[str, jax.Array]) -> tuple[Any, None]:
        return jax.tree.map(jnp.add, total, grad_fn(params, micro)), None

    first = {name: x[0] for name, x in split.items()}
    (loss, metrics), grads = jax.tree.map(
        lambda leaf: jnp.zeros(leaf.shape, leaf.dtype), jax.eval_shape(grad_fn, params, first)
    )
    if mesh is not None:  # the gradient sum lives sharded like the parameters (FSDP)
        grads = jax.lax.with_sharding_constraint(grads, state_shardings(grads, mesh))
    total, _ = jax.lax.scan(add, ((loss, metrics), grads), split)
    return total


def make_eval_step(
    *, mesh: Mesh
) -> Callable[[TrainState, Mapping[str, Any]], dict[str, jax.Array]]:
    """fn(state, batch) -> {"loss_sum": sum of masked next-token CE in nats, "token_count"}."""

    def eval_step(state: TrainState, batch: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
        model = nnx.merge(state.graphdef, state.params)
        hidden = model.hidden_states(batch["tokens"], batch.get("segment_ids"))
        cross_entropy, _ = token_losses(hidden, model.output_weights(), batch["tokens"])
        mask = batch["loss_mask"][:, :-1].astype(jnp.float32)
        return {"loss_sum": (cross_entropy * mask).sum(), "token_count": mask.sum()}

    return _under_mesh(jax.jit(eval_step), mesh)


def make_logprob_fn(
    graphdef: nnx.GraphDef, *, with_is_argmax: bool = False
) -> Callable[[TrainState | nnx.State, np.ndarray], Any]:
    """fn(state or params, tokens int32 [B, T]) -> float32 numpy [B, T - 1] of
    log p(tokens[:, t + 1] | tokens[:, :t + 1]); with_is_argmax: also a bool [B, T - 1] that says
    whether tokens[:, t + 1] is the model's argmax (lm-eval's is_greedy).

    The model reads tokens[:, :-1] (the last token is only a target), so T may be max_seq_len + 1:
    lm-eval's max_length counts input tokens. Jitted per (B, T): callers bucket shapes. Rows are
    single sequences (no segment ids).
    """

    @jax.jit
    def log_probs(params: nnx.State, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
        logits = nnx.merge(graphdef, params)(tokens[:, :-1]).astype(jnp.float32)
        targets = tokens[:, 1:]
        picked = jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], axis=-1)
        return picked[..., 0], jnp.argmax(logits, axis=-1) == targets

    def logprob_fn(state_or_params: TrainState | nnx.State, tokens: np.ndarray) -> Any:
        params = state_or_params
        if isinstance(state_or_params, TrainState):
            params = state_or_params.params
        values, is_argmax = jax.device_get(log_probs(params, jnp.asarray(tokens, jnp.int32)))
        return (values, is_argmax) if with_is_argmax else values

    return logprob_fn


def shard_batch(batch: Mapping[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
    """Host numpy batch -> global arrays split over ("data", "fsdp") along the batch dimension.

    `batch` is the whole global batch. With several processes (multi-host) every process passes
    the same one (the mixture is deterministic) and places only the rows its own devices hold.
    Without segment_ids every row is one sequence.
    """
    missing = sorted(set(BATCH_FIELDS) - set(batch) - set(OPTIONAL_BATCH_FIELDS))
    if missing:
        raise ValueError(f"batch is missing field(s) {missing}; expected {sorted(BATCH_FIELDS)}")
    fields = {name: dtype for name, dtype in BATCH_FIELDS.items() if name in batch}
    shapes = {name: np.shape(batch[name]) for name in fields}
    if len(set(shapes.values())) != 1 or len(shapes["tokens"]) != 2:
        raise ValueError(f"batch fields must all be [batch, seq_len] arrays, got shapes {shapes}")
    global_batch = shapes["tokens"][0]
    ways = batch_parallelism(mesh)
    if global_batch % ways:
        raise ValueError(
            f"global batch size {global_batch} is not divisible by the mesh's data * fsdp = {ways}"
        )
    sharding = batch_sharding(mesh)
    arrays = {name: np.asarray(batch[name], dtype) for name, dtype in fields.items()}
    return {
        name: jax.make_array_from_callback(array.shape, sharding, array.__getitem__)
        for name, array in arrays.items()
    }


def _initializer(
    model_config: LlamaConfig,
    adam_config: AdamConfig,
    num_train_steps: int,
    options: ModelOptions,
) -> Callable[[jax.Array], TrainState]:
    optimizer = build_optimizer(adam_config, num_train_steps)

    def init(key: jax.Array) -> TrainState:
        model = Llama(model_config, rngs=nnx.Rngs(params=key), **options.llama_kwargs())
        graphdef, params = nnx.split(model)
        if model_config.initialization == "levanter":
            dtype = options.param_dtype
            nnx.replace_by_pure_dict(params, levanter_parameters(model_config, key, dtype))
        return TrainState(
            graphdef=graphdef,
            params=params,
            opt_state=optimizer.init(params),
            step=jnp.zeros((), jnp.int32),
        )

    return init


@functools.cache
def _sharded_initializer(
    model_config: LlamaConfig,
    adam_config: AdamConfig,
    num_train_steps: int,
    options: ModelOptions,
    mesh: Mesh,
) -> Callable[[jax.Array], TrainState]:
    """The jitted initializer, cached so that another seed (or a second run) does not recompile."""
    init = _initializer(model_config, adam_config, num_train_steps, options)
    shardings = state_shardings(jax.eval_shape(init, jax.random.key(0)), mesh)
    return jax.jit(init, out_shardings=shardings)


def _under_mesh(fn: Callable, mesh: Mesh) -> Callable:
    """Traces and runs `fn` with `mesh` as the context mesh (the model's activation sharding
    constraints name its axes)."""

    def run(*args: Any) -> Any:
        with jax.set_mesh(mesh):
            return fn(*args)

    return run
