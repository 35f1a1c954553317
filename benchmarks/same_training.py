"""One training, several ways: the losses of the same model on the same batches under attention
implementations and platforms, side by side, and a resumed run against an uninterrupted one.

    python3 benchmarks/same_training.py --attention pallas --out pallas.json        # TPU
    python3 benchmarks/same_training.py --attention xla --out xla.json              # TPU
    JAX_PLATFORMS=cpu python3 benchmarks/same_training.py --attention xla --out cpu.json
    python3 benchmarks/same_training.py --attention pallas --resume-at 50 --out resumed.json
    python3 benchmarks/same_training.py --compare pallas.json xla.json cpu.json resumed.json

Each run trains --steps steps of a small Llama (head dim 128, bf16 compute) from seed 0 on the
same random batches (a fresh batch per step, packed documents as in the docs layout). With
--resume-at N the state is copied to the host after step N and placed back, as a restore does,
and training goes on. --compare prints, against the first file, the largest and the mean
absolute loss difference and the last loss of each, and says whether each is bit-identical.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

MODEL = dict(
    max_seq_len=1024,
    hidden_dim=512,
    intermediate_dim=2048,
    num_heads=4,
    num_kv_heads=4,
    num_layers=4,
    vocab_size=8192,
)


def train(attention: str, steps: int, batch_size: int, seq_len: int, resume_at: int | None):
    import jax
    from segment_layouts import segment_ids  # benchmarks/segment_layouts.py

    from kiln.model.config import LlamaConfig
    from kiln.train.mesh import make_mesh
    from kiln.train.optimizer import AdamConfig
    from kiln.train.step import ModelOptions, init_train_state, make_train_step, shard_batch

    config = LlamaConfig(**MODEL)
    mesh = make_mesh({"data": -1})
    adam = AdamConfig()
    options = ModelOptions(compute_dtype="bfloat16", attention=attention, remat="none")
    state = init_train_state(config, adam, steps, seed=0, mesh=mesh, options=options)
    train_step = make_train_step(adam, steps, z_loss_weight=1e-4, mesh=mesh)
    rng = np.random.default_rng(0)
    losses = []
    for step in range(steps):
        tokens = rng.integers(0, config.vocab_size, (batch_size, seq_len), dtype=np.int32)
        batch = {
            "tokens": tokens,
            "loss_mask": np.ones(tokens.shape, np.float32),
            "segment_ids": segment_ids("docs", batch_size, seq_len, seed=step),
        }
        state, metrics = train_step(state, shard_batch(batch, mesh))
        losses.append(float(metrics["loss"]))
        if resume_at is not None and step + 1 == resume_at:
            host = jax.device_get(state)  # what a checkpoint holds
            state = jax.device_put(host, jax.tree.map(lambda x: x.sharding, state))
    device = jax.devices()[0]
    return {
        "attention": attention,
        "device": f"{device.platform}: {device.device_kind}",
        "jax": jax.__version__,
        "resume_at": resume_at,
        "losses": losses,
    }


def compare(paths: list[str]) -> None:
    runs = [json.load(open(path)) for path in paths]
    base = np.asarray(runs[0]["losses"])
    print(f"{'run':<28} {'device':<22} {'max |d|':>9} {'mean |d|':>9} {'last loss':>10} identical")
    for path, run in zip(paths, runs):
        losses = np.asarray(run["losses"])
        difference = np.abs(losses - base)
        print(
            f"{path:<28} {run['device'][:22]:<22} {difference.max():>9.2e} "
            f"{difference.mean():>9.2e} {losses[-1]:>10.5f} {bool((losses == base).all())}"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--attention", default="pallas")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--resume-at", type=int)
    parser.add_argument("--out")
    parser.add_argument("--compare", nargs="+", metavar="JSON")
    args = parser.parse_args(argv)
    if args.compare:
        compare(args.compare)
        return
    run = train(args.attention, args.steps, args.batch_size, args.seq_len, args.resume_at)
    print(f"{run['device']} jax {run['jax']} {args.attention}: losses {run['losses'][::10]}")
    if args.out:
        with open(args.out, "w") as file:
            json.dump(run, file)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
