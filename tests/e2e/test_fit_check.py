"""End to end: `./pants plan --fit` compiles two trainings' steps for a 4-chip TPU v5e
(v5e:2x2, libtpu's mock devices) on this CPU machine, through the user's path: one fits, one
does not and is given the remedy that fits (its state sharded instead of replicated); a second
`plan --fit` is served from Pants' cache. docs/fitting.md.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from tests.e2e.test_pants_e2e import pants, pants_command

TARGETS = """
FIT_RUN = dict(
    optimizer=adam(learning_rate=1e-2, warmup=2),
    datasets={"//experiments:stdlib_validation": 1.0},
    validation=["//experiments:stdlib_validation"],
    num_train_steps=10,
    z_loss_weight=None,
    evals=None,
    resources=tpu("v5litepod-4"),
)

lm_checkpoint(
    name="fits",
    artifact_name="checkpoints/fit_ci/fits",
    version="2026.12.07",
    model=llama(max_seq_len=64, hidden_dim=32, intermediate_dim=64, num_heads=2,
                num_kv_heads=1, num_layers=1),
    batch_size=8,
    seq_len=64,
    **FIT_RUN,
)

# 1.2B parameters in one wide layer (a refusal compiles in seconds), its parameters and Adam
# state replicated on every chip (mesh data=4): 13.5 GiB a chip before any temporaries.
lm_checkpoint(
    name="too_big",
    artifact_name="checkpoints/fit_ci/too_big",
    version="2026.12.07",
    model=llama(max_seq_len=128, hidden_dim=8192, intermediate_dim=32768, num_heads=64,
                num_kv_heads=64, num_layers=1),
    batch_size=4,
    seq_len=128,
    mesh={"data": -1},
    **FIT_RUN,
)
"""
V5E_HBM = 15.75 * 2**30  # what libtpu 0.0.48.1's compiler gives a v5e chip


def test_plan_fit_compiles_for_a_four_chip_slice(workspace: Path) -> None:
    repo = workspace
    (repo / "experiments/fit_ci").mkdir()
    (repo / "experiments/fit_ci/BUILD").write_text(TARGETS)

    # Compiled here, or served by Pants' cache from an earlier run of these same inputs.
    fitting = pants(repo, "plan", "--fit", "experiments/fit_ci:fits")
    text = fitting.stdout
    assert "on v5litepod-4: v5e:2x2, 4 x TPU v5 lite, 15.75 GiB HBM a chip" in text
    assert "declared: fsdp=4, 2 seq a pass x 1, remat none" in text
    assert "fits: peak 0.01 of 15.75 GiB a chip" in text

    refused = subprocess.run(
        pants_command("plan", "--fit", "--plan-json", "experiments/fit_ci:too_big"),
        cwd=repo, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert refused.returncode == 1, refused.stdout + refused.stderr  # it does not fit
    (training,) = json.loads(refused.stdout)["training"]
    fit = training["fit"]
    assert fit["fits"] is False and fit["status"] == "does not fit"
    target = fit["target"]
    assert (target["slice"], target["topology"], target["chips"]) == ("v5litepod-4", "v5e:2x2", 4)
    declared = fit["declared"]
    assert declared["status"] == "does not fit" and declared["memory"] is None
    assert declared["choice"]["mesh_sizes"] == {"data": 4, "fsdp": 1, "tensor": 1}
    # The compiler's refusal, with its numbers, beside the state the chip would hold.
    assert "Ran out of memory on HBM" in declared["message"]
    assert declared["hbm_bytes"] == V5E_HBM and declared["required_bytes"] > 0
    assert declared["state_bytes"] > 13 * 2**30
    # The cheapest remedy: the same step with its state sharded over the four chips.
    suggestion = fit["suggestion"]
    assert suggestion["build_fields"] == {"mesh": {"fsdp": -1}}
    assert suggestion["status"] == "fits" and suggestion["memory"]["peak"] < V5E_HBM
    assert suggestion["state_bytes"] < declared["state_bytes"] / 3

    again = pants(repo, "plan", "--fit", "experiments/fit_ci:fits")  # served, not compiled
    assert "Compiling" not in again.stderr
    assert "fits: peak 0.01 of 15.75 GiB a chip" in again.stdout
