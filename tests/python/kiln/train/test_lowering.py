"""A whole bf16 train step with the Pallas kernel lowers for an H200, checked on this CPU machine.

jax.export for platform 'cuda' under an abstract H200 mesh (the kernel engineer's helper,
tests/python/kiln/kernels/h200_export.py): the kernel lowers to Triton as on the device. Nothing
is compiled to PTX or run.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from kiln.kernels.h200_export import TRITON_CUSTOM_CALL, export_for_h200
from kiln.model.config import LlamaConfig
from kiln.train.mesh import make_mesh
from kiln.train.optimizer import AdamConfig
from kiln.train.step import abstract_train_state, train_step_fn

MODEL = LlamaConfig(
    max_seq_len=128,
    hidden_dim=128,
    intermediate_dim=256,
    num_heads=2,  # head_dim 64, as on the device
    num_kv_heads=1,
    num_layers=2,
    vocab_size=256,
)
ADAM = AdamConfig()


@pytest.mark.parametrize("remat", ["none", "save_dots", "offload"])
def test_bf16_train_step_with_pallas_lowers_for_h200(remat: str) -> None:
    state = abstract_train_state(
        MODEL,
        ADAM,
        100,
        mesh=make_mesh(),
        compute_dtype="bfloat16",
        attention="pallas",
        remat=remat,
    )
    state = jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype), state)
    batch = {
        "tokens": jax.ShapeDtypeStruct((2, 128), jnp.int32),
        "segment_ids": jax.ShapeDtypeStruct((2, 128), jnp.int32),
        "loss_mask": jax.ShapeDtypeStruct((2, 128), jnp.float32),
    }
    step = train_step_fn(ADAM, 100, z_loss_weight=1e-4, mesh=None)
    exported = export_for_h200(step, state, batch)
    assert exported.platforms == ("cuda",)
    module = exported.mlir_module()
    # Forward, dK/dV and dQ kernels lowered to Triton (each once: the jitted kernel becomes a
    # function that every layer calls).
    assert module.count(TRITON_CUSTOM_CALL) >= 3, module.count(TRITON_CUSTOM_CALL)
    assert "bf16" in module
    if remat == "offload":
        assert "pinned_host" in module  # saved activations go to host memory
