"""End to end on a cluster: real ./pants builds a 2-run sweep with `[kiln] cluster` pointing at a
two-node Ray cluster on loopback (kiln_testing.ray_cluster, one CPU each, the local store shared
by both nodes): each run is a job of its own, both submitted at once, so their training steps
overlap in time.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from kiln_testing.ray_cluster import ray_cluster

from tests.e2e.test_pants_e2e import pants
from tests.e2e.workspace import copy_workspace

SWEEP = """
lm_sweep(
    name="pair",
    version="2026.12.02",
    base=dict(
        model=llama(max_seq_len=64, hidden_dim=32, intermediate_dim=64, num_heads=2,
                    num_kv_heads=1, num_layers=1),
        optimizer=adam(learning_rate=1e-2, warmup=2),
        datasets={"//experiments:stdlib_validation": 1.0},
        validation=[],
        batch_size=4,
        seq_len=64,
        num_train_steps=300,  # long enough that two runs started together overlap
        z_loss_weight=None,
        evals=None,
        resources=cpu(),
        compute_dtype="float32",
    ),
    grid={"seed": [1, 2]},
)
"""


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    with ray_cluster({}, devices=1) as address:
        yield address


def test_a_sweep_submits_its_trainings_at_once(cluster: str, tmp_path: Path) -> None:
    repo = copy_workspace(tmp_path)
    (repo / "experiments/pair").mkdir()
    (repo / "experiments/pair/BUILD").write_text(SWEEP)

    result = pants(repo, f"--kiln-cluster={cluster}", "build", "experiments/pair:pair")
    assert "3 step(s) built or served." in result.stderr  # the cache and both runs
    spans = []
    for seed in (1, 2):
        run = repo / f"artifacts/checkpoints/pair-seed{seed}/2026.12.02"
        assert (run / "STATUS").read_text().strip() == "SUCCESS"
        provenance = json.loads((run / "artifact.json").read_text())["provenance"]
        assert provenance["cluster_job"]["id"]  # trained as a job of the cluster
        stamps = [json.loads(line)["timestamp"] for line in (run / "metrics.jsonl").open()
                  if "train/loss" in line]  # fmt: skip
        spans.append((min(stamps), max(stamps)))
    jobs = {json.loads((repo / f"artifacts/checkpoints/pair-seed{s}/2026.12.02/artifact.json")
                       .read_text())["provenance"]["cluster_job"]["id"] for s in (1, 2)}  # fmt: skip
    assert len(jobs) == 2  # each run its own job
    (first_a, last_a), (first_b, last_b) = spans
    assert max(first_a, first_b) < min(last_a, last_b), spans  # trained at the same time
