from __future__ import annotations

import jax
import pytest
from flax import nnx

from kiln.model.config import LlamaConfig, flops_per_token, num_parameters
from kiln.model.llama import Llama
from kiln_contract.llama import LlamaArchitecture
from kiln_contract.parsing import SpecError

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


def test_from_json_round_trips_and_applies_defaults() -> None:
    config = LlamaConfig.from_json(TINY)
    assert config.rope_theta == 500000.0 and config.norm_eps == 1e-5
    assert config.tie_embeddings is False and config.init_std == 0.02
    assert LlamaConfig.from_json(config.to_json()) == config
    assert config.head_dim == 16


def test_initialization_is_in_the_json_only_when_set() -> None:
    # Unset, the JSON (and so every fingerprint) is what it was before the field existed.
    assert "initialization" not in LlamaConfig(**TINY).to_json()
    levanter = LlamaConfig(**TINY, initialization="levanter")
    assert levanter.to_json()["initialization"] == "levanter"
    assert LlamaConfig.from_json(levanter.to_json()) == levanter
    with pytest.raises(SpecError, match="initialization: expected one of normal, levanter"):
        LlamaConfig(**TINY, initialization="xavier")


def test_the_architecture_of_a_step_gets_the_caches_vocabulary() -> None:
    architecture = LlamaArchitecture.from_json({k: v for k, v in TINY.items() if k != "vocab_size"})
    assert LlamaConfig.for_vocabulary(architecture, 50) == LlamaConfig(**TINY)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"hidden_size": 64}, r"model: unknown field\(s\) hidden_size"),
        ({"num_layers": None}, "model.num_layers: expected an integer >= 1, got None"),
        ({"num_heads": 3}, r"model.hidden_dim: 64 is not divisible by num_heads \(3\)"),
        ({"num_kv_heads": 3}, r"model.num_heads: 4 is not a multiple of num_kv_heads \(3\)"),
        ({"num_heads": 8, "num_kv_heads": 8, "hidden_dim": 40}, "head_dim .* = 5 must be even"),
        ({"rope_theta": "big"}, "model.rope_theta: expected a number > 0, got 'big'"),
        ({"tie_embeddings": 1}, "model.tie_embeddings: expected true or false, got 1"),
        ({"vocab_size": 0}, "model.vocab_size: expected an integer >= 1, got 0"),
    ],
)
def test_from_json_rejects_bad_values(change: dict, message: str) -> None:
    with pytest.raises(SpecError, match=message):
        LlamaConfig.from_json({**TINY, **change})


def test_from_json_names_missing_fields() -> None:
    values = dict(TINY)
    del values["vocab_size"]
    with pytest.raises(SpecError, match="model.vocab_size: required field is missing"):
        LlamaConfig.from_json(values)
