"""The model alone from a checkpoint (kiln.train.checkpoints): its parameters, laid out as the
trainer shards them, without the optimizer state; for the readers of a trained run (export,
evaluation)."""

from __future__ import annotations

import jax
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import Mesh

from kiln.model.config import LlamaConfig
from kiln.model.llama import abstract_llama
from kiln.train.checkpoints import PARAMS_KEY, STATE_DIR, CheckpointInfo, check_intact
from kiln.train.mesh import state_shardings


def restore_params(
    checkpoint: CheckpointInfo,
    model_config: LlamaConfig,
    *,
    mesh: Mesh,
    compute_dtype: str,
    param_dtype: str,
    attention: str = "xla",
) -> tuple[nnx.GraphDef, nnx.State]:
    """The model saved at `checkpoint`: (graphdef, parameters) laid out on `mesh` as the trainer
    shards them, for nnx.merge or kiln.model.sample. Only the parameters are read, not the
    optimizer state (twice their size). `attention` is the graphdef's kernel: XLA by default,
    since a short sampling buffer need not suit a kernel's block sizes. Multi-host: every
    process calls it (the restore is a collective). CheckpointDamaged when a state file is not
    what was saved."""
    check_intact(checkpoint)
    graphdef, abstract = abstract_llama(
        model_config, compute_dtype=compute_dtype, param_dtype=param_dtype, attention=attention
    )
    target = {
        PARAMS_KEY: jax.tree.map(
            lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
            abstract,
            state_shardings(abstract, mesh),
        )
    }
    reader = ocp.PyTreeCheckpointer()
    try:
        restored = reader.restore(
            checkpoint.path / STATE_DIR,
            args=ocp.args.PyTreeRestore(
                item=target,
                restore_args=ocp.checkpoint_utils.construct_restore_args(target),
                partial_restore=True,  # the parameters alone
            ),
        )
    finally:
        reader.close()
    return graphdef, restored[PARAMS_KEY]
