from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kiln.model.config import LlamaConfig
from kiln.model.llama import Llama
from kiln.train.optimizer import (
    AdamConfig,
    build_optimizer,
    learning_rate_schedule,
    warmup_and_decay_steps,
    weight_decay_mask,
)


def lr_at(config: AdamConfig, num_train_steps: int, step: int) -> float:
    return float(learning_rate_schedule(config, num_train_steps)(step))


def test_defaults_are_levanters() -> None:
    assert AdamConfig() == AdamConfig(
        learning_rate=6e-4,
        weight_decay=0.1,
        beta1=0.9,
        beta2=0.95,
        epsilon=1e-8,
        max_grad_norm=1.0,
        warmup=0.01,
        decay=None,
        min_lr_ratio=0.1,
        lr_schedule="cosine",
    )


def test_cosine_schedule_by_hand() -> None:
    # 100 steps, warmup 0.1 -> 10 steps from 0 to 1e-3, then cosine over 90 steps to 1e-4.
    config = AdamConfig(learning_rate=1e-3, warmup=0.1, min_lr_ratio=0.1)
    assert lr_at(config, 100, 0) == 0.0
    assert lr_at(config, 100, 5) == pytest.approx(5e-4)
    assert lr_at(config, 100, 10) == pytest.approx(1e-3)
    # Halfway through the decay (step 55): 1e-4 + (1e-3 - 1e-4) * (1 + cos(pi / 2)) / 2.
    assert lr_at(config, 100, 55) == pytest.approx(5.5e-4)
    # A third of the way (step 40): 1e-4 + 9e-4 * (1 + cos(pi / 3)) / 2 = 1e-4 + 9e-4 * 0.75.
    assert lr_at(config, 100, 40) == pytest.approx(7.75e-4)
    assert lr_at(config, 100, 100) == pytest.approx(1e-4)
    assert lr_at(config, 100, 150) == pytest.approx(1e-4)


def test_warmup_in_steps_and_linear_decay_with_a_stable_phase() -> None:
    # warmup 20 steps, decay over the last 40 of 100: peak holds for steps 20..60.
    config = AdamConfig(learning_rate=2.0, warmup=20, decay=0.4, lr_schedule="linear")
    assert warmup_and_decay_steps(config, 100) == (20, 40)
    assert lr_at(config, 100, 10) == pytest.approx(1.0)
    assert lr_at(config, 100, 20) == pytest.approx(2.0)
    assert lr_at(config, 100, 59) == pytest.approx(2.0)
    assert lr_at(config, 100, 80) == pytest.approx(2.0 - (2.0 - 0.2) * 20 / 40)  # 1.1
    assert lr_at(config, 100, 100) == pytest.approx(0.2)


def test_constant_and_inv_sqrt_schedules() -> None:
    constant = AdamConfig(learning_rate=1.0, warmup=4, lr_schedule="constant")
    assert [lr_at(constant, 50, s) for s in (0, 2, 4, 49)] == pytest.approx([0, 0.5, 1, 1])
    # Levanter's: the peak until step 10000 (its timescale), then sqrt(10000 / step).
    inv_sqrt = AdamConfig(learning_rate=1.0, warmup=4, lr_schedule="inv_sqrt", min_lr_ratio=0.3)
    assert lr_at(inv_sqrt, 200_000, 4) == pytest.approx(1.0)
    assert lr_at(inv_sqrt, 200_000, 10_000) == pytest.approx(1.0)
    assert lr_at(inv_sqrt, 200_000, 40_000) == pytest.approx(math.sqrt(10_000 / 40_000))
    assert lr_at(inv_sqrt, 200_000, 199_999) == pytest.approx(0.3)  # 0.224 < floor


def test_one_is_the_whole_run_and_more_is_steps() -> None:
    # Levanter's _convert_frac_or_steps: up to 1 a fraction, above it whole steps.
    assert warmup_and_decay_steps(AdamConfig(warmup=1), 40) == (40, 0)
    assert warmup_and_decay_steps(AdamConfig(warmup=1.0, decay=None), 40) == (40, 0)
    assert warmup_and_decay_steps(AdamConfig(warmup=2, decay=0.5), 40) == (2, 20)
    with pytest.raises(ValueError, match="neither a fraction"):
        AdamConfig(warmup=2.5)


def test_schedule_rejects_impossible_phases() -> None:
    with pytest.raises(ValueError, match="warmup"):
        learning_rate_schedule(AdamConfig(warmup=200), 100)
    with pytest.raises(ValueError, match="warmup \\+ decay"):
        learning_rate_schedule(AdamConfig(warmup=50, decay=60), 100)


def test_mask_decays_linear_weights_only_on_a_real_model() -> None:
    config = LlamaConfig(
        max_seq_len=8,
        hidden_dim=16,
        intermediate_dim=32,
        num_heads=2,
        num_kv_heads=1,
        num_layers=1,
        vocab_size=11,
    )
    params = nnx.state(nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0))), nnx.Param)
    mask = weight_decay_mask(params)
    decayed = {
        jax.tree_util.keystr(path, simple=True, separator="/")
        for path, flag in jax.tree_util.tree_flatten_with_path(mask)[0]
        if flag
    }
    assert decayed == {
        "blocks/0/attention/q_proj/kernel/value",
        "blocks/0/attention/k_proj/kernel/value",
        "blocks/0/attention/v_proj/kernel/value",
        "blocks/0/attention/o_proj/kernel/value",
        "blocks/0/mlp/gate_proj/kernel/value",
        "blocks/0/mlp/up_proj/kernel/value",
        "blocks/0/mlp/down_proj/kernel/value",
        "lm_head/kernel/value",
    }
    assert len(jax.tree.leaves(mask)) == len(decayed) + 4  # embedding, 3 norm scales


def test_one_update_is_clipped_adamw() -> None:
    config = AdamConfig(
        learning_rate=0.1, weight_decay=0.5, max_grad_norm=1.0, warmup=0, lr_schedule="constant"
    )
    params = {"kernel": jnp.full((2,), 2.0), "embedding": jnp.full((2,), 2.0)}
    grads = {"kernel": jnp.asarray([3.0, 0.0]), "embedding": jnp.asarray([0.0, 4.0])}
    optimizer = build_optimizer(config, 10)
    updates, _ = optimizer.update(grads, optimizer.init(params), params)
    # Global norm 5 -> clipped grads [0.6, 0], [0, 0.8]. Adam's first step with bias correction
    # gives g / (|g| + eps) = sign(g). Decay adds 0.5 * 2.0 to the kernel only; lr 0.1.
    expected_kernel = -0.1 * (np.asarray([1.0, 0.0]) + 0.5 * 2.0)
    expected_embedding = -0.1 * np.asarray([0.0, 1.0])
    np.testing.assert_allclose(updates["kernel"], expected_kernel, rtol=1e-6)
    np.testing.assert_allclose(updates["embedding"], expected_embedding, rtol=1e-6)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"learning_rate": 0}, "optimizer.learning_rate: expected a number > 0"),
        ({"beta2": 1.0}, "optimizer.beta2: expected a number >= 0 and < 1"),
        ({"lr_schedule": "cos"}, "optimizer.lr_schedule: expected one of cosine"),
        ({"warmup": "5%"}, "optimizer.warmup: expected a number >= 0, got '5%'"),
        ({"lr": 1e-3}, r"optimizer: unknown field\(s\) lr"),
    ],
)
def test_from_json_rejects_bad_values(values: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        AdamConfig.from_json(values)


def test_from_json_round_trips() -> None:
    config = AdamConfig.from_json({"learning_rate": 3e-3, "warmup": 5000, "max_grad_norm": None})
    assert AdamConfig.from_json(config.to_json()) == config
