"""One forward+backward of Kiln's flash attention (tuned table) at one size: what a profiler looks at.

    ncu --clock-control none --kernel-name regex:kiln_flash --launch-count 3 \
        python3 benchmarks/attention_once.py --seq-len 4096 --head-dim 128 [--block-sizes tuned.json]

Each kernel (forward, dK/dV, dQ; two with LaunchParams.fused_dq) launches exactly once after
compilation.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from attention import load_block_sizes  # benchmarks/attention.py

from kiln.kernels.flash_attention import flash_attention


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=16384, help="batch = tokens / seq")
    parser.add_argument("--model-dim", type=int, default=2048, help="heads = model_dim / head_dim")
    parser.add_argument("--non-causal", action="store_true")
    parser.add_argument(
        "--block-sizes", help="a settings file (a tuner's JSON) instead of the table"
    )
    args = parser.parse_args(argv)
    block_sizes, launch = load_block_sizes(args.block_sizes).get(args.head_dim, (None, None))
    shape = (
        max(1, args.tokens // args.seq_len),
        args.seq_len,
        max(1, args.model_dim // args.head_dim),
        args.head_dim,
    )
    q, k, v = (
        jax.random.normal(key, shape, jnp.bfloat16)
        for key in jax.random.split(jax.random.key(0), 3)
    )

    def loss(q, k, v):
        out = flash_attention(
            q, k, v, causal=not args.non_causal, block_sizes=block_sizes, launch=launch
        )
        return jnp.sum(out.astype(jnp.float32))

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile()
    jax.block_until_ready(grads(q, k, v))
    print(f"ran fwd+bwd once: {shape} {jax.devices()[0].device_kind}")


if __name__ == "__main__":
    main()
