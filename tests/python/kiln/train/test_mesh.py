"""Mesh construction and sharding rules (in-process: one CPU device; abstract meshes for the
multi-device rules. Real 4-device runs are in test_step.py)."""

from __future__ import annotations

import jax
import pytest
from flax import nnx
from jax.sharding import AbstractMesh, AxisType, PartitionSpec

from kiln.model.config import LlamaConfig
from kiln.model.llama import Llama
from kiln.train.mesh import MESH_AXES, batch_parallelism, make_mesh, state_shardings

CONFIG = LlamaConfig(
    max_seq_len=8,
    hidden_dim=32,
    intermediate_dim=48,
    num_heads=4,
    num_kv_heads=2,
    num_layers=1,
    vocab_size=10,
)


def abstract_mesh(data: int, fsdp: int, tensor: int) -> AbstractMesh:
    return AbstractMesh((data, fsdp, tensor), MESH_AXES, axis_types=(AxisType.Auto,) * 3)


def abstract_params():
    return nnx.state(nnx.eval_shape(lambda: Llama(CONFIG, rngs=nnx.Rngs(0))), nnx.Param)


def test_default_mesh_puts_every_device_on_data() -> None:
    mesh = make_mesh()
    assert mesh.axis_names == MESH_AXES
    assert dict(mesh.shape) == {"data": jax.device_count(), "fsdp": 1, "tensor": 1}
    assert set(mesh.axis_types) == {AxisType.Auto}
    assert batch_parallelism(mesh) == jax.device_count()


def test_minus_one_takes_the_rest() -> None:
    mesh = make_mesh({"data": 1, "fsdp": -1}, devices=jax.devices()[:1])
    assert dict(mesh.shape) == {"data": 1, "fsdp": 1, "tensor": 1}


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"model": 1}, "unknown mesh axis"),
        ({"data": -1, "fsdp": -1}, "at most one mesh axis may be -1"),
        ({"data": 0}, "mesh.data must be a positive integer or -1"),
        ({"data": 2}, "needs a multiple of 2 devices, but there are 1"),
        ({"data": -1, "tensor": 2}, "needs a multiple of 2 devices, but there are 1"),
    ],
)
def test_bad_meshes_are_rejected(config: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_mesh(config, devices=jax.devices()[:1])


def test_parameters_shard_hidden_over_fsdp_and_heads_over_tensor() -> None:
    shardings = state_shardings(abstract_params(), abstract_mesh(1, 2, 2))
    attention, mlp = shardings["blocks"][0]["attention"], shardings["blocks"][0]["mlp"]
    assert attention["q_proj"]["kernel"].spec == PartitionSpec("fsdp", "tensor")
    assert attention["o_proj"]["kernel"].spec == PartitionSpec("tensor", "fsdp")
    assert mlp["up_proj"]["kernel"].spec == PartitionSpec("fsdp", "tensor")
    assert mlp["down_proj"]["kernel"].spec == PartitionSpec("tensor", "fsdp")
    assert shardings["embed"]["embedding"].spec == PartitionSpec("tensor", "fsdp")
    assert shardings["lm_head"]["kernel"].spec == PartitionSpec("fsdp", "tensor")
    assert shardings["final_norm"]["scale"].spec == PartitionSpec(None)


def test_a_mesh_that_does_not_divide_a_parameter_names_it() -> None:
    # vocab 10 over tensor=4 does not divide.
    with pytest.raises(ValueError, match=r"embed.*embedding.*size 10.*'tensor' of size 4"):
        state_shardings(abstract_params(), abstract_mesh(1, 1, 4))
