"""The multi-chip TPU step on CPU: the train step's loss and gradients with the Mosaic (TPU)
attention kernel, run per shard under shard_map on an fsdp x tensor mesh of 8 CPU devices, equal
the one-device step's within bf16 rounding.

The Mosaic kernels run in Pallas' TPU interpret mode; everything else is the step a TPU slice
compiles (bf16 compute, fsdp-sharded parameters and batch, heads split over "tensor", packed
documents, grouped-query attention, a remat policy).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from kiln.kernels import flash_attention
from kiln.model.config import LlamaConfig
from kiln.train.mesh import make_mesh
from kiln.train.optimizer import AdamConfig
from kiln.train.step import ModelOptions, gradients_fn, init_train_state, shard_batch

SEQ_LEN = 128  # one Mosaic tile (tiles are multiples of 128 lanes)
MODEL = LlamaConfig(
    max_seq_len=SEQ_LEN,
    hidden_dim=512,  # head dim 128, the Mosaic kernel's
    intermediate_dim=256,
    num_heads=4,  # 2 query heads and 1 K/V head on each "tensor" shard
    num_kv_heads=2,
    num_layers=1,
    vocab_size=128,
)
ADAM = AdamConfig(learning_rate=1e-2, warmup=2)
# bf16 compute: the two runs differ by their rounding alone. Seen: the worst parameter's gradient
# 2.2e-2 apart in norm (a bf16 run and a float32 run of one device are 2.5e-2 apart; in float32
# the sharded step matches to 1.4e-6), the loss 2e-6. Shards that pair query heads with the wrong
# K/V heads give gradients ~1.1 apart.
GRADIENT_RTOL = 5e-2
LOSS_RTOL = 1e-4


def packed_batch(batch_size: int = 8) -> dict[str, np.ndarray]:
    """Two documents per row, split at a different place in every row."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, MODEL.vocab_size, (batch_size, SEQ_LEN)).astype(np.int32)
    positions = np.arange(SEQ_LEN)
    boundaries = rng.integers(16, SEQ_LEN - 16, batch_size)
    segment_ids = np.where(positions[None, :] < boundaries[:, None], 1, 2).astype(np.int32)
    loss_mask = np.ones(tokens.shape, np.float32)
    loss_mask[:, -1] = 0
    return {"tokens": tokens, "segment_ids": segment_ids, "loss_mask": loss_mask}


def loss_and_gradients(mesh_config: dict[str, int], devices, remat: str):
    mesh = make_mesh(mesh_config, devices)
    options = ModelOptions(compute_dtype="bfloat16", attention="pallas", remat=remat)
    state = init_train_state(MODEL, ADAM, 10, seed=0, mesh=mesh, options=options)
    gradients = jax.jit(gradients_fn(z_loss_weight=1e-4, mesh=mesh))
    with jax.set_mesh(mesh):
        (loss, _), grads = gradients(state, shard_batch(packed_batch(), mesh))
    leaves = jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(grads))
    return float(loss), {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in leaves}


@pytest.fixture
def mosaic_on_cpu(monkeypatch):
    """The TPU kernels on this CPU (TPU interpret mode) where the Triton ones would run."""
    monkeypatch.setitem(flash_attention.PLATFORM_LOWERINGS, "cpu", "mosaic")


def test_fsdp_and_tensor_sharded_mosaic_step_gives_the_one_device_gradients(mosaic_on_cpu) -> None:
    # XLA_FLAGS in this folder's BUILD gives this file's pytest process (a batch of its own) 8.
    assert jax.device_count() == 8, f"8 CPU devices wanted, jax has {jax.devices()}"
    one_loss, one_grads = loss_and_gradients({"data": 1}, jax.devices()[:1], remat="none")
    # save_dots: the kernel's output and lse are kept from the forward (kiln.model.llama's
    # policy names them) and its backward runs per shard too.
    loss, grads = loss_and_gradients({"fsdp": 4, "tensor": 2}, None, remat="save_dots")
    assert grads.keys() == one_grads.keys()
    errors = {
        name: float(np.linalg.norm(grads[name] - expected) / np.linalg.norm(expected))
        for name, expected in one_grads.items()
    }
    assert max(errors.values()) < GRADIENT_RTOL, errors
    assert loss == pytest.approx(one_loss, rel=LOSS_RTOL)
