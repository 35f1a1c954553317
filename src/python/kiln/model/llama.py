"""A Llama in flax.nnx: RMSNorm, RoPE, grouped-query attention, SwiGLU (see docs/model.md).

Parameters are stored in `param_dtype` and cast to `compute_dtype` where they are used; norms,
RoPE and the attention softmax run in float32; logits come out in float32.
Every parameter carries a sharding annotation over the mesh axes ("data", "fsdp", "tensor"):
hidden (embed) dimensions over "fsdp", heads / MLP / vocab dimensions over "tensor".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from kiln.model.attention import attention, resolve_attention_impl
from kiln.model.config import LlamaConfig
from kiln.model.partitioning import constrain_batch_sharding, param_sharding
from kiln_contract.vocabulary import REMAT_POLICIES

LinearFactory = Callable[[int, int, tuple[str, str]], nnx.Linear]


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, *, param_dtype: jnp.dtype) -> None:
        self.scale = nnx.Param(jnp.ones((dim,), param_dtype), **param_sharding(None))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (normed * self.scale[...].astype(jnp.float32)).astype(x.dtype)


class Attention(nnx.Module):
    def __init__(self, config: LlamaConfig, linear: LinearFactory, attention_impl: str) -> None:
        d, head_dim = config.hidden_dim, config.head_dim
        self.q_proj = linear(d, config.num_heads * head_dim, ("fsdp", "tensor"))
        self.k_proj = linear(d, config.num_kv_heads * head_dim, ("fsdp", "tensor"))
        self.v_proj = linear(d, config.num_kv_heads * head_dim, ("fsdp", "tensor"))
        self.o_proj = linear(config.num_heads * head_dim, d, ("tensor", "fsdp"))
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = head_dim
        self.attention_impl = attention_impl

    def __call__(
        self, x: jax.Array, segment_ids: jax.Array | None, cos: jax.Array, sin: jax.Array
    ) -> jax.Array:
        batch, seq_len, _ = x.shape
        q = self.q_proj(x).reshape(batch, seq_len, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(batch, seq_len, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(batch, seq_len, self.num_kv_heads, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = attention(q, k, v, segment_ids, impl=self.attention_impl)
        return self.o_proj(out.reshape(batch, seq_len, self.num_heads * self.head_dim))


class SwiGLU(nnx.Module):
    def __init__(self, config: LlamaConfig, linear: LinearFactory) -> None:
        d, hidden = config.hidden_dim, config.intermediate_dim
        self.gate_proj = linear(d, hidden, ("fsdp", "tensor"))
        self.up_proj = linear(d, hidden, ("fsdp", "tensor"))
        self.down_proj = linear(hidden, d, ("tensor", "fsdp"))

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nnx.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(
        self,
        config: LlamaConfig,
        linear: LinearFactory,
        param_dtype: jnp.dtype,
        attention_impl: str,
    ) -> None:
        self.attention_norm = RMSNorm(config.hidden_dim, config.norm_eps, param_dtype=param_dtype)
        self.attention = Attention(config, linear, attention_impl)
        self.mlp_norm = RMSNorm(config.hidden_dim, config.norm_eps, param_dtype=param_dtype)
        self.mlp = SwiGLU(config, linear)

    def __call__(
        self, x: jax.Array, segment_ids: jax.Array | None, cos: jax.Array, sin: jax.Array
    ) -> jax.Array:
        x = x + self.attention(self.attention_norm(x), segment_ids, cos, sin)
        x = x + self.mlp(self.mlp_norm(x))
        return constrain_batch_sharding(x)


class Llama(nnx.Module):
    def __init__(
        self,
        config: LlamaConfig,
        *,
        rngs: nnx.Rngs,
        compute_dtype: jnp.dtype = jnp.bfloat16,
        param_dtype: jnp.dtype = jnp.float32,
        attention: str = "xla",
        remat: str = "none",
    ) -> None:
        if remat not in REMAT_POLICIES:
            raise ValueError(f"remat must be one of {REMAT_POLICIES}, got {remat!r}")
        attention_impl = resolve_attention_impl(attention)
        linear = _linear_factory(config, rngs, compute_dtype, param_dtype)
        self.config = config
        self.remat = remat
        self.compute_dtype = compute_dtype
        self.embed = nnx.Embed(
            config.vocab_size,
            config.hidden_dim,
            dtype=compute_dtype,
            param_dtype=param_dtype,
            embedding_init=nnx.initializers.normal(config.init_std),
            embedding_metadata=param_sharding("tensor", "fsdp"),
            rngs=rngs,
        )
        self.blocks = nnx.List(
            [Block(config, linear, param_dtype, attention_impl) for _ in range(config.num_layers)]
        )
        self.final_norm = RMSNorm(config.hidden_dim, config.norm_eps, param_dtype=param_dtype)
        self.lm_head = (
            None
            if config.tie_embeddings
            else linear(config.hidden_dim, config.vocab_size, ("fsdp", "tensor"))
        )

    def __call__(self, tokens: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
        """tokens int32 [B, T], segment_ids int32 [B, T] or None -> float32 logits [B, T, V]."""
        return self.logits(self.hidden_states(tokens, segment_ids))

    def hidden_states(self, tokens: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
        """The final norm's output [B, T, D] in the compute dtype: what the lm head reads. The
        training loss takes it with output_weights() (kiln.train.loss), never the whole logits."""
        seq_len = tokens.shape[1]
        if seq_len > self.config.max_seq_len:
            raise ValueError(
                f"sequence length {seq_len} exceeds LlamaConfig.max_seq_len "
                f"{self.config.max_seq_len}"
            )
        # Positions count from 0 per window, not per packed document (see docs/model.md).
        cos, sin = rope_tables(seq_len, self.config.head_dim, self.config.rope_theta)
        x = constrain_batch_sharding(self.embed(tokens))
        run_block = _remat(Block.__call__, self.remat)
        for block in self.blocks:
            x = run_block(block, x, segment_ids, cos, sin)
        return self.final_norm(x)

    def output_weights(self) -> jax.Array:
        """The lm head as [D, V] in the parameter dtype: its kernel, or the embedding transposed
        when tied."""
        if self.lm_head is None:
            return self.embed.embedding[...].T
        return self.lm_head.kernel[...]

    def logits(self, hidden: jax.Array) -> jax.Array:
        """float32 [B, T, V] logits of hidden_states(): compute-dtype matmul, float32 out (float32
        accumulation, no rounding to bf16)."""
        weights = self.output_weights().astype(self.compute_dtype)
        return jnp.einsum("btd,dv->btv", hidden, weights, preferred_element_type=jnp.float32)


def abstract_llama(
    config: LlamaConfig,
    *,
    compute_dtype: str = "bfloat16",
    param_dtype: str = "float32",
    attention: str = "xla",
) -> tuple[nnx.GraphDef, nnx.State]:
    """The model's structure without values: (graphdef, parameters as ShapeDtypeStructs), to
    read saved or imported parameters into or to merge with a trained state's (nothing is
    initialised). XLA attention by default: a reader's short inputs need not suit a kernel's
    block sizes."""
    model = nnx.eval_shape(
        lambda: Llama(
            config,
            rngs=nnx.Rngs(params=jax.random.key(0)),
            compute_dtype=jnp.dtype(compute_dtype),
            param_dtype=jnp.dtype(param_dtype),
            attention=attention,
        )
    )
    return nnx.split(model)


def rope_tables(seq_len: int, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos and sin, float32 [T, D/2], for positions 0..T-1."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    angles = jnp.arange(seq_len, dtype=jnp.float32)[:, None] * inv_freq[None, :]
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotates [B, T, H, D] features pairwise (i, i + D/2), the Hugging Face Llama layout."""
    x32 = x.astype(jnp.float32)
    first, second = jnp.split(x32, 2, axis=-1)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    rotated = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
    return rotated.astype(x.dtype)


def _remat(block_call: Callable, policy: str) -> Callable:
    if policy == "none":
        return block_call
    return nnx.remat(block_call, policy=_remat_policy(policy))


def _remat_policy(policy: str) -> Callable:
    """jax.checkpoint's policy for a remat name. save_dots and offload also keep the flash-attention
    kernel's output and log-sum-exp (named residuals), so the backward runs the backward kernels
    only, never the forward kernel again."""
    from kiln.kernels.flash_attention import ATTENTION_RESIDUALS  # lazily, as attention does

    policies = jax.checkpoint_policies
    if policy == "full":
        return policies.nothing_saveable
    save_attention = policies.save_only_these_names(*ATTENTION_RESIDUALS)
    if policy == "save_dots":
        return policies.save_from_both_policies(
            policies.dots_with_no_batch_dims_saveable, save_attention
        )
    offload_dots = policies.offload_dot_with_no_batch_dims("device", "pinned_host")

    def offload_dots_save_attention(primitive: Any, *args: Any, **params: Any) -> Any:
        # The attention residuals stay on the device: the backward reads them first thing.
        return save_attention(primitive, *args, **params) or offload_dots(
            primitive, *args, **params
        )

    return offload_dots_save_attention


def _linear_factory(
    config: LlamaConfig, rngs: nnx.Rngs, compute_dtype: jnp.dtype, param_dtype: jnp.dtype
) -> LinearFactory:
    """Bias-free linear layers of the model's dtypes and initialisation: (in, out, sharding)."""

    def linear(in_features: int, out_features: int, sharding: tuple[str, str]) -> nnx.Linear:
        return nnx.Linear(
            in_features,
            out_features,
            use_bias=False,
            dtype=compute_dtype,
            param_dtype=param_dtype,
            kernel_init=nnx.initializers.normal(config.init_std),
            kernel_metadata=param_sharding(*sharding),
            rngs=rngs,
        )

    return linear
