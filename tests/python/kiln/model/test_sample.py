"""generate(): shapes, prompts kept, greedy = the model's own step-by-step argmax, one compile."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kiln.model import sample
from kiln.model.config import LlamaConfig
from kiln.model.llama import Llama
from kiln.model.sample import generate

# A large init_std gives peaked logits: greedy choices are far from ties.
CONFIG = LlamaConfig(
    max_seq_len=32,
    hidden_dim=32,
    intermediate_dim=64,
    num_heads=4,
    num_kv_heads=2,
    num_layers=2,
    vocab_size=61,
    init_std=0.5,
)


@pytest.fixture(scope="module")
def model() -> Llama:
    return Llama(CONFIG, rngs=nnx.Rngs(0), compute_dtype=jnp.float32)


def prompts(batch: int, length: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, CONFIG.vocab_size, (batch, length), np.int32)


def run(model: Llama, prompt: np.ndarray, **options) -> np.ndarray:
    graphdef, params = nnx.split(model)
    options = {"max_new_tokens": 6, "temperature": 0.0, "seed": 0, **options}
    return generate(graphdef, params, prompt, max_seq_len=CONFIG.max_seq_len, **options)


def test_shape_and_prompt_are_kept(model: Llama) -> None:
    prompt = prompts(3, 5)
    out = run(model, prompt, temperature=0.8, max_new_tokens=7)
    assert out.shape == (3, 12) and out.dtype == np.int32
    np.testing.assert_array_equal(out[:, :5], prompt)
    assert ((out >= 0) & (out < CONFIG.vocab_size)).all()


def test_greedy_is_the_models_argmax_step_by_step(model: Llama) -> None:
    prompt = prompts(2, 4, seed=1)
    out = run(model, prompt, max_new_tokens=8)
    # Teacher forcing: one causal forward over the result gives, at each position, the logits the
    # model had when it chose the next token; greedy means every choice is their argmax.
    graphdef, params = nnx.split(model)
    logits = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))(params, out[:, :-1])
    np.testing.assert_array_equal(out[:, 4:], np.asarray(logits)[:, 3:].argmax(-1))
    np.testing.assert_array_equal(run(model, prompt, max_new_tokens=8, seed=7), out)


def test_sampling_is_reproducible_by_seed(model: Llama) -> None:
    prompt = prompts(4, 3, seed=2)
    first = run(model, prompt, temperature=1.5, seed=1, max_new_tokens=10)
    np.testing.assert_array_equal(
        run(model, prompt, temperature=1.5, seed=1, max_new_tokens=10), first
    )
    other = run(model, prompt, temperature=1.5, seed=2, max_new_tokens=10)
    assert not np.array_equal(other, first)
    greedy = run(model, prompt, max_new_tokens=10)
    assert not np.array_equal(greedy, first)  # temperature > 0 does sample


def test_one_compilation_per_buffer_shape(model: Llama) -> None:
    before = sample._decode._cache_size()
    # Same buffer [2, 17]: other seeds, temperatures and prompt lengths reuse one compilation.
    run(model, prompts(2, 9), max_new_tokens=8, temperature=0.0)
    run(model, prompts(2, 9), max_new_tokens=8, temperature=0.7, seed=3)
    run(model, prompts(2, 5), max_new_tokens=12, temperature=1.0, seed=4)
    assert sample._decode._cache_size() == before + 1


def test_rejects_a_buffer_longer_than_the_model(model: Llama) -> None:
    with pytest.raises(ValueError, match="max_seq_len 32"):
        run(model, prompts(1, 30), max_new_tokens=3)
