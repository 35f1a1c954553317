"""End to end: a 4-run sweep of ci_tiny-sized models through real ./pants in the e2e tests'
workspace (conftest.py): `build` of the sweep's target trains its runs over their shared cache while an unrelated
cache is held back (its merge waits for a lease this test holds: the pipeline trains the sweep
anyway, and `./pants --concurrent store` lists the store beside the running build), then
`compare` prints the table and writes the CSV and the plot.
"""

from __future__ import annotations

import csv
import json
import subprocess
import time
from pathlib import Path

from kiln.artifacts.lease import Lease, lease_key
from kiln.artifacts.locations import open_store
from tests.e2e.test_pants_e2e import pants, pants_command

SWEEP = """
lm_sweep(
    name="sweep",
    version="2026.12.02",
    base=dict(
        model=llama(max_seq_len=64, hidden_dim=32, intermediate_dim=64, num_heads=2,
                    num_kv_heads=1, num_layers=1),
        optimizer=adam(learning_rate=1e-2, warmup=2),
        datasets={"//experiments:stdlib_validation": 1.0},
        validation=["//experiments:stdlib_validation"],
        batch_size=4,
        seq_len=64,
        num_train_steps=8,
        z_loss_weight=None,
        evals=None,
        resources=cpu(),
        compute_dtype="float32",
    ),
    grid={"hidden_dim": [16, 32], "learning_rate": [1e-2, 3e-3]},
)

# Unrelated to the sweep: a store-mode cache whose merge the test holds back.
tokenized_cache(
    name="held",
    artifact_name="tokenized/held",
    source="stdlib:pydoc_topics",
    split="validation",
    tokenizer="//experiments/tokenizers:kiln-stdlib-8k",
    version="2026.11.29",
    storage="store",
)
"""
RUNS = ["sweep-d16-lr1e-2", "sweep-d16-lr3e-3", "sweep-d32-lr1e-2", "sweep-d32-lr3e-3"]

def test_a_sweep_builds_past_a_held_cache_and_compares(workspace: Path) -> None:
    repo = workspace
    (repo / "experiments/sweep_ci").mkdir()
    (repo / "experiments/sweep_ci/BUILD").write_text(SWEEP)
    store = repo / "artifacts"

    # The lease of the held cache's folder, which its merge process waits for.
    held = Lease(open_store(str(store / "tokenized/held")), lease_key("2026.11.29"), what="a test")
    held.acquire(wait=False)
    built = subprocess.Popen(
        pants_command("build", "experiments/sweep_ci:sweep", "experiments/sweep_ci:held"),
        cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        trained = wait_for_runs(store, built, deadline=time.monotonic() + 900)
        assert not (store / "tokenized/held/2026.11.29/STATUS").exists()  # still held back
        listed_beside_the_build(repo)
    finally:
        held.release()
    stdout, stderr = built.communicate(timeout=900)
    assert built.returncode == 0, stdout[-3000:] + stderr[-5000:]
    assert trained, stderr[-5000:]
    assert (store / "tokenized/held/2026.11.29/STATUS").read_text().strip() == "SUCCESS"
    assert "6 step(s) built or served." in stderr  # the 4 runs and the 2 caches
    compare_sweep(repo)


def listed_beside_the_build(repo: Path) -> None:
    """`pants store` beside a running `build` of the same checkout, as docs/artifacts.md says:
    `./pants --concurrent store`. The held cache is listed with the lease that holds it."""
    listed = subprocess.run(pants_command("--concurrent", "store", daemon=False), cwd=repo,
                            capture_output=True, text=True, timeout=600)  # fmt: skip
    assert listed.returncode == 0, listed.stdout[-3000:] + listed.stderr[-3000:]
    lines = listed.stdout.splitlines()
    [row] = [i for i, line in enumerate(lines) if "tokenized/held@2026.11.29" in line]
    assert "experiments/sweep_ci:held" in lines[row], listed.stdout
    assert lines[row + 1].strip().startswith("leased: a test (host "), listed.stdout


def wait_for_runs(store: Path, build: subprocess.Popen, deadline: float) -> bool:
    """Whether every run of the sweep trained (STATUS SUCCESS) while the held cache waited."""
    statuses = [store / "checkpoints" / name / "2026.12.02/STATUS" for name in RUNS]
    while time.monotonic() < deadline and build.poll() is None:
        if all(s.exists() and s.read_text().strip() == "SUCCESS" for s in statuses):
            return True
        time.sleep(2)
    return False


def compare_sweep(repo: Path) -> None:
    result = pants(repo, "compare", "experiments/sweep_ci:sweep")
    printed = result.stdout.split("\nwrote ")[0]
    assert max(map(len, printed.splitlines())) <= 100, printed  # numbered runs, column blocks
    names = [f"checkpoints/{name}@2026.12.02" for name in
             ["sweep-d16-lr3e-3", "sweep-d16-lr1e-2", "sweep-d32-lr3e-3", "sweep-d32-lr1e-2"]]  # fmt: skip
    assert [line.split() for line in printed.splitlines()[2:6]] == [
        [str(number), name] for number, name in enumerate(names, start=1)
    ]
    out = repo / "dist/compare/sweep"
    with open(out / "compare.csv") as f:
        table = list(csv.DictReader(f))
    assert list(table[0])[:4] == ["run", "model.hidden_dim", "optimizer.learning_rate", "state"]
    assert "eval/stdlib_validation/loss" in table[0] and "FLOPs" in table[0]
    assert [r["run"] for r in table] == names
    assert all(r["state"] == "built" for r in table)
    assert [r["model.hidden_dim"] for r in table] == ["16", "16", "32", "32"]
    losses = [float(r["eval/stdlib_validation/loss"]) for r in table]
    summaries = [
        json.loads((repo / "artifacts/checkpoints" / name.split("@")[0].split("/")[1]
                    / "2026.12.02/summary.json").read_text())
        for name in names
    ]  # fmt: skip
    assert losses == [float(f"{s['eval/stdlib_validation/loss']:.4g}") for s in summaries]
    assert (out / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "against training FLOPs" in result.stdout
