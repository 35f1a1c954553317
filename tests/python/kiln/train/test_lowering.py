"""A whole bf16 train step with the Pallas kernel lowers for an H200, checked on this CPU machine.

jax.export for platform 'cuda' under an abstract H200 mesh (the kernel engineer's helper,
kiln.kernels.device_export): the kernel lowers to Triton as on the device. Nothing
is compiled to PTX or run here.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from kiln.kernels import block_sizes
from kiln.kernels.device_export import TRITON_CUSTOM_CALL, export_for_h200
from kiln.model.config import LlamaConfig
from kiln.train.mesh import make_mesh
from kiln.train.optimizer import AdamConfig
from kiln.train.step import ModelOptions, abstract_train_state, train_step_fn

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


H200 = "NVIDIA H200"
TABLE_BLOCKS, TABLE_LAUNCH = block_sizes.TUNED_BLOCK_SIZES[H200][64]
# The layout a tuned table can switch on (what benchmarks/train_step.py --block-sizes does).
LAYOUTS = {"fused-dq": (TABLE_BLOCKS, dataclasses.replace(TABLE_LAUNCH, fused_dq=True))}


@pytest.mark.parametrize("remat", ["none", "save_dots", "offload"])
@pytest.mark.parametrize("layout", ["table", *LAYOUTS])
def test_bf16_train_step_with_pallas_lowers_for_h200(
    remat: str, layout: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # flash_attention reads the table when it is traced: drop traces made under another table.
    jax.clear_caches()
    if layout != "table":
        monkeypatch.setitem(block_sizes.TUNED_BLOCK_SIZES, H200, {64: LAYOUTS[layout]})
    _, launch = block_sizes.TUNED_BLOCK_SIZES[H200][64]
    state = abstract_train_state(
        MODEL,
        ADAM,
        100,
        mesh=make_mesh(),
        options=ModelOptions(compute_dtype="bfloat16", attention="pallas", remat=remat),
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
    # Every kernel of the layout lowered, each at least once (the jitted kernel becomes a
    # function that every layer calls): the forward, dK/dV, and dQ unless dK/dV computes it
    # (fused_dq).
    kernels = ["fwd", "dkv"] + ([] if launch.fused_dq else ["dq"])
    assert module.count(TRITON_CUSTOM_CALL) >= len(kernels), launch
    for kernel in ("fwd", "dkv", "dq"):
        assert (f"kiln_flash_attention_{kernel}" in module) == (kernel in kernels), kernel
    assert "bf16" in module
    if remat == "offload":
        assert "pinned_host" in module  # saved activations go to host memory
