from __future__ import annotations

import jax
import pytest
from flax import nnx

from kiln.model.config import LlamaConfig, flops_per_token, num_parameters
from kiln.model.llama import Llama

TINY = dict(
    max_seq_len=32,
    hidden_dim=64,
    intermediate_dim=96,
    num_heads=4,
    num_kv_heads=2,
    num_layers=2,
    vocab_size=50,
)
# The reference's "1.4B" Llama (untied, Llama-3 vocabulary).
REFERENCE_1_4B = LlamaConfig(
    max_seq_len=4096,
    hidden_dim=2048,
    intermediate_dim=8192,
    num_heads=16,
    num_kv_heads=16,
    num_layers=24,
    vocab_size=128256,
)


@pytest.mark.parametrize("tie_embeddings", [False, True])
def test_num_parameters_matches_the_model(tie_embeddings: bool) -> None:
    config = LlamaConfig(**TINY, tie_embeddings=tie_embeddings)
    model = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0)))
    actual = sum(leaf.size for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert num_parameters(config) == actual


def test_num_parameters_of_the_reference_1_4b_by_hand() -> None:
    embedding = 128256 * 2048  # 262,668,288
    attention = 4 * 2048 * 2048  # q, k, v, o with 16 kv heads of 128: 16,777,216
    mlp = 3 * 2048 * 8192  # gate, up, down: 50,331,648
    norms = 2 * 2048  # attention_norm, mlp_norm
    per_layer = attention + mlp + norms  # 67,112,960
    lm_head = 2048 * 128256  # untied: 262,668,288
    expected = embedding + 24 * per_layer + 2048 + lm_head
    assert expected == 2_136_049_664
    assert num_parameters(REFERENCE_1_4B) == expected


def test_flops_per_token_by_hand() -> None:
    matmul_params = 24 * (4 * 2048 * 2048 + 3 * 2048 * 8192) + 2048 * 128256
    attention = 12 * 24 * 4096 * 16 * 128  # QK^T and AV, forward + backward
    assert flops_per_token(REFERENCE_1_4B, 4096) == 6 * matmul_params + attention


def test_from_dict_round_trips_and_applies_defaults() -> None:
    config = LlamaConfig.from_dict(TINY)
    assert config.rope_theta == 500000.0 and config.norm_eps == 1e-5
    assert config.tie_embeddings is False and config.init_std == 0.02
    assert LlamaConfig.from_dict(config.to_dict()) == config
    assert config.head_dim == 16


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"hidden_size": 64}, "unknown LlamaConfig field.*hidden_size"),
        ({"num_layers": None}, "num_layers must be a positive integer"),
        ({"num_heads": 3}, "hidden_dim .64. must be divisible by num_heads .3."),
        ({"num_kv_heads": 3}, "num_heads .4. must be divisible by num_kv_heads .3."),
        ({"rope_theta": "big"}, "rope_theta must be a positive number"),
        ({"tie_embeddings": 1}, "tie_embeddings must be true or false"),
    ],
)
def test_from_dict_rejects_bad_values(change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LlamaConfig.from_dict({**TINY, **change})


def test_from_dict_names_missing_fields() -> None:
    values = dict(TINY)
    del values["vocab_size"]
    with pytest.raises(ValueError, match=r"missing required field\(s\) \['vocab_size'\]"):
        LlamaConfig.from_dict(values)
