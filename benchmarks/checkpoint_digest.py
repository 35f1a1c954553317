"""What checkpoint digests cost: orbax's save and restore alone, against the sha256 of every
state file that Kiln records on commit and checks on restore.

    ./pants run benchmarks/checkpoint_digest.py -- [--state-mb 512] [--repeat 3]

A state of float32 arrays (`--state-mb` in all, in 8 arrays) is saved by orbax's
StandardCheckpointer alone (the baseline: what a save cost before digests), and then through
`kiln.train.checkpoints.Checkpointer.save`, which waits for orbax and digests the files it wrote
on the save's background thread (`record_files`, 8 threads) before writing metadata.json and
renaming the staging folder to step-N (timed alone too: the same rename moves a damaged
checkpoint aside). On
restore, the baseline is orbax's restore; Kiln first checks every file against its digest
(`checkpoints.damage`). The files are read back from the page cache, as they are right after a
save or on a resume on the machine that saved them; a restore on another machine reads them
from disk once more. Each figure is the median of `--repeat` runs; ratios are against orbax's
own save or restore in the same run. Digesting runs on the save's thread, off the training
loop: it lengthens the time until a checkpoint is complete, not the training held up.
"""

from __future__ import annotations

import argparse
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from report_table import markdown_table

from kiln.artifacts.content import files_under, record_files
from kiln.train.checkpoints import STATE_DIR, Checkpointer, damage

ARRAYS = 8


def make_state(megabytes: int) -> dict[str, Any]:
    elements = megabytes * (1 << 20) // 4 // ARRAYS
    rng = np.random.default_rng(0)
    return {f"w{i}": jnp.asarray(rng.standard_normal(elements, np.float32)) for i in range(ARRAYS)}


def timed(fn: Any) -> tuple[float, Any]:
    began = time.perf_counter()
    result = fn()
    return time.perf_counter() - began, result


def orbax_save(folder: Path, state: dict[str, Any]) -> float:
    writer = ocp.StandardCheckpointer()
    try:
        seconds, _ = timed(lambda: (writer.save(folder, state), writer.wait_until_finished()))
    finally:
        writer.close()
    return seconds


def one_round(work: Path, state: dict[str, Any]) -> dict[str, float]:
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    baseline_save = orbax_save(work / "orbax" / STATE_DIR, state)
    checkpointer = Checkpointer(
        work / "kiln", work / "kiln", save_interval_seconds=1e9, keep_last_temporary=1, every=None
    )
    try:
        kiln_save, info = timed(lambda: checkpointer.save(1, state, temporary=False))
        folder = info.path / STATE_DIR
        digest, _ = timed(lambda: record_files(folder, files_under(folder)))
        like = jax.tree.map(jnp.zeros_like, state)
        restore, _ = timed(lambda: jax.block_until_ready(checkpointer.restore(info, like)))
        verify, problem = timed(lambda: damage(info))
        assert problem is None, problem
        # What the checkpoint retention rules add: the rename that makes a save appear whole
        # (also what moving a damaged checkpoint aside costs), timed on this saved folder.
        staged = info.path.with_name(".step-1.saving")
        rename, _ = timed(lambda: (info.path.rename(staged), staged.rename(info.path)))
    finally:
        checkpointer.close()
    return {
        "orbax save": baseline_save,
        "Kiln save (orbax + digests + rename)": kiln_save,
        "digests of the saved files": digest,
        "rename into place (or aside)": rename / 2,
        "orbax restore": restore,
        "digest check before restore": verify,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--state-mb", type=int, default=512)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    state = make_state(args.state_mb)
    gigabytes = sum(a.nbytes for a in state.values()) / 1e9
    with tempfile.TemporaryDirectory(prefix="kiln-digest-bench-") as work:
        rounds = [one_round(Path(work) / "round", state) for _ in range(args.repeat)]
    medians = {name: statistics.median(r[name] for r in rounds) for name in rounds[0]}
    baselines = {"save": medians["orbax save"], "restore": medians["orbax restore"]}
    rows = []
    for name, seconds in medians.items():
        baseline = baselines["restore" if "restore" in name else "save"]
        ratio = seconds / baseline
        rows.append([name, f"{seconds:.4f}", f"{seconds / gigabytes:.3f}", f"{ratio:.4f}x"])
    print(f"{gigabytes:.2f} GB of float32 state in {ARRAYS} arrays, median of {args.repeat}; "
          f"{platform.processor() or platform.machine()}, jax {jax.__version__}")  # fmt: skip
    print(markdown_table(["operation", "seconds", "s per GB", "vs orbax's own"], rows))


if __name__ == "__main__":
    main()
