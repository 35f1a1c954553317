"""Levanter's initialisation of a Llama, value for value (`llama(..., initialization="levanter")`).

Levanter's `train_lm` splits `PRNGKey(trainer.seed)` into (data, loader, model, training) keys
and builds `LlamaLMHeadModel.init(Vocab, config, key=model_key)`. Every weight is a truncated
normal on [-3, 3] (haliax's `Linear.init` and `Embedding.init`), scaled by

- a linear layer's weight: 1 / sqrt(fan-in) (q, k, v, gate, up: hidden_dim; o: heads x head_dim;
  down: intermediate_dim; the lm head: hidden_dim);
- the embedding: 1 / hidden_dim;
- norm weights: 1.

Its `initializer_range` (0.02) is not used. The untied lm head is drawn with the embedding's own
key, so it is the embedding's draw scaled by sqrt(hidden_dim) (levanter/models/llama.py,
`LlamaLMHeadModel.init`): reproduced here, since it is what Levanter trains.

The keys follow Levanter's tree (model key -> transformer and embedding keys; one key per layer,
the transformer key itself for a one-layer model; per layer attention and MLP keys; q, k, v, o and gate, up, down), and the draws are made in
Levanter's `out_first` shapes then laid out as Kiln's `[in, out]` kernels, so for one seed the
parameters equal Levanter's exactly (tests/python/kiln/train/test_levanter_parity.py).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from kiln.model.config import LlamaConfig

# Levanter's train_lm: data_key, loader_key, model_key, training_key = split(PRNGKey(seed), 4).
_SEED_SPLITS, _MODEL_KEY = 4, 2


def levanter_parameters(config: LlamaConfig, seed_key: jax.Array, dtype: Any) -> dict[str, Any]:
    """The parameter tree of Llama(config) (nnx.to_pure_dict's layout) as Levanter's train_lm
    initialises it from `seed_key` = PRNGKey(trainer.seed), in `dtype`."""
    model_key = jax.random.split(seed_key, _SEED_SPLITS)[_MODEL_KEY]
    transformer_key, embedding_key = jax.random.split(model_key, 2)
    d, vocab = config.hidden_dim, config.vocab_size
    embedding_draw = _truncated_normal(embedding_key, (vocab, d))
    params: dict[str, Any] = {
        "embed": {"embedding": embedding_draw / d},
        "blocks": {
            i: _block(config, key) for i, key in enumerate(_layer_keys(transformer_key, config))
        },
        "final_norm": {"scale": jnp.ones((d,), jnp.float32)},
    }
    if not config.tie_embeddings:
        params["lm_head"] = {"kernel": (embedding_draw / math.sqrt(d)).T}
    return jax.tree.map(lambda x: x.astype(dtype), params)


def _layer_keys(transformer_key: jax.Array, config: LlamaConfig) -> jax.Array:
    """One key per layer as haliax's `shaped_rng_split(key, num_layers)` makes them for
    Levanter's stacked layers: a split, except for one layer, which gets the key unsplit."""
    if config.num_layers == 1:
        return transformer_key[None]
    return jax.random.split(transformer_key, config.num_layers)


def _block(config: LlamaConfig, key: jax.Array) -> dict[str, Any]:
    attention_key, mlp_key = jax.random.split(key, 2)
    q, k, v, o = jax.random.split(attention_key, 4)
    gate, up, down = jax.random.split(mlp_key, 3)
    d, head_dim, mlp = config.hidden_dim, config.head_dim, config.intermediate_dim
    q_width, kv_width = config.num_heads * head_dim, config.num_kv_heads * head_dim
    ones = jnp.ones((d,), jnp.float32)
    return {
        "attention_norm": {"scale": ones},
        "attention": {
            # q's out_first axes are (kv_head, q_heads_per_group, head_size): query head
            # kv * group + g, Kiln's grouped-query layout too.
            "q_proj": {"kernel": _linear(q, d, q_width)},
            "k_proj": {"kernel": _linear(k, d, kv_width)},
            "v_proj": {"kernel": _linear(v, d, kv_width)},
            "o_proj": {"kernel": _linear(o, q_width, d)},
        },
        "mlp_norm": {"scale": ones},
        "mlp": {
            "gate_proj": {"kernel": _linear(gate, d, mlp)},
            "up_proj": {"kernel": _linear(up, d, mlp)},
            "down_proj": {"kernel": _linear(down, mlp, d)},
        },
    }


def _linear(key: jax.Array, fan_in: int, fan_out: int) -> jax.Array:
    """haliax's Linear.init(out_first=True): an [out, in] draw / sqrt(in), as Kiln's [in, out]."""
    return (_truncated_normal(key, (fan_out, fan_in)) / math.sqrt(fan_in)).T


def _truncated_normal(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    return jax.random.truncated_normal(key, -3.0, 3.0, shape, jnp.float32)
