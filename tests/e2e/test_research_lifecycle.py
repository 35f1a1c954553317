"""End to end, the research lifecycle as docs/training.md tells it ("Runs that start from
runs"), on experiments/lifecycle in the e2e tests' workspace: `pants build` trains a run, then
its cooldown from the run's final weights on a mixture that changes half way, and scores both
as evaluation artifacts; `pants compare` sets them side by side with their loss curves; a
supervised fine-tuning of the run on chats trains on the assistant's tokens alone, as `plan`
says; and after the run's config changes, `plan` shows the cooldown stale (another fingerprint
for its version) instead of built.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from kiln.data.cache import TokenCache
from tests.e2e.test_pants_e2e import pants, pants_command

STORE = "artifacts"
BASE = "checkpoints/lifecycle/base/2026.12.02"
COOLDOWN = "checkpoints/lifecycle/cooldown/2026.12.02"
SFT = "checkpoints/lifecycle/sft/2026.12.06"
EVALS = {"base": "evals/lifecycle/base/2026.12.02", "cooldown": "evals/lifecycle/cooldown/2026.12.02"}
LOSS = "eval/stdlib_validation/loss"


def read(repo: Path, folder: str, name: str) -> dict:
    return json.loads((repo / STORE / folder / name).read_text())


# Another target of the repository with a stage list that does not start at 0: it fails what
# reads it, never `pants run` or `compare` of the targets beside it.
BROKEN = """lm_checkpoint(
    name="bad", version="2026.12.02", model=llama(max_seq_len=64, hidden_dim=32,
    intermediate_dim=64, num_heads=2, num_kv_heads=1, num_layers=1),
    optimizer=adam(learning_rate=1e-3, warmup=0),
    datasets=[(5, {"//experiments/lifecycle:docstrings": 1.0})], validation=[],
    batch_size=4, seq_len=64, num_train_steps=20, resources=cpu(),
)
"""


def test_a_run_its_cooldown_and_their_evaluations(workspace: Path) -> None:
    broken = workspace / "experiments/bad_stages/BUILD"
    broken.parent.mkdir()
    broken.write_text(BROKEN)
    try:
        lifecycle_beside_a_broken_target(workspace)
    finally:
        broken.unlink()
        broken.parent.rmdir()


def lifecycle_beside_a_broken_target(repo: Path) -> None:
    built = pants(repo, "build", "experiments/lifecycle:lifecycle")
    for folder in (BASE, COOLDOWN, *EVALS.values()):
        assert (repo / STORE / folder / "STATUS").read_text().strip() == "SUCCESS", built.stderr

    # The cooldown started from the run's final state (weights and Adam's moments) and its data
    # stream, the run named by fingerprint in its identity.
    base, cooldown = read(repo, BASE, "artifact.json"), read(repo, COOLDOWN, "artifact.json")
    assert cooldown["identity"]["init_from"] == {
        "kind": "lm_checkpoint", "name": "checkpoints/lifecycle/base", "version": "2026.12.02",
        "fingerprint": base["fingerprint"], "optimizer_state": True, "data_continues": True,
    }  # fmt: skip
    assert {"ref": "checkpoints/lifecycle/base@2026.12.02",
            "fingerprint": base["fingerprint"]} in cooldown["inputs"]  # fmt: skip
    log = (repo / "dist/logs/checkpoints/lifecycle/cooldown/2026.12.02.log").read_text()
    assert "started from checkpoints/lifecycle/base@2026.12.02" in log
    # Its own schedule from step 0: no warmup, linear to zero.
    rates = [json.loads(line).get("optim/learning_rate")
             for line in (repo / STORE / COOLDOWN / "metrics.jsonl").read_text().splitlines()]  # fmt: skip
    rates = [r for r in rates if r is not None]
    assert rates[0] == pytest.approx(1e-3) and rates[-1] == pytest.approx(1e-3 / 20)
    # Its data continued the run's: the docstrings from the 160th sequence of the run's shuffle
    # (40 steps of 4), the topics, new to it, from their beginning.
    config = read(repo, COOLDOWN, "config.json")
    final = read(repo, BASE, "checkpoints/step-40/metadata.json")["data"]
    assert config["mixture"]["continues"] == final
    assert [d["read"] for d in final["datasets"].values()] == [160]
    # It starts where the run ended, on the same validation windows (Kiln's default for both,
    # though they train 40 and 20 steps), and ends below it.
    base_loss = read(repo, BASE, "summary.json")[LOSS]
    first = next(json.loads(line) for line in (repo / STORE / COOLDOWN / "metrics.jsonl")
                 .read_text().splitlines() if LOSS in line)  # fmt: skip
    assert (first["step"], first[LOSS]) == (0, base_loss)
    assert read(repo, COOLDOWN, "summary.json")[LOSS] < base_loss
    # Its mixture changed at step 10: only the high-quality source after it.
    assert [stage["counts"] for stage in config["mixture"]["sequences_per_block"]] == [
        {"tokenized/lifecycle/docstrings": 20, "tokenized/lifecycle/topics": 20},
        {"tokenized/lifecycle/topics": 40},
    ]

    # Each evaluation scores what its run reported for the same windows.
    for run, folder in (("base", BASE), ("cooldown", COOLDOWN)):
        scores = read(repo, EVALS[run], "results.json")["metrics"]
        assert scores[LOSS] == pytest.approx(read(repo, folder, "summary.json")[LOSS], rel=1e-5)
        assert 0.0 <= scores["lm_eval/kiln_stdlib_mc/acc"] <= 1.0

    compared = pants(repo, "compare", "experiments/lifecycle:lifecycle")
    printed = compared.stdout.split("\nwrote ")[0]
    assert max(map(len, printed.splitlines())) <= 100, printed  # numbered runs, column blocks
    legend = [line.split(maxsplit=1)[1] for line in printed.splitlines()[2:6]]
    assert sorted(legend[:2]) == ["checkpoints/lifecycle/base@2026.12.02",
                                  "checkpoints/lifecycle/cooldown@2026.12.02"]  # fmt: skip
    assert legend[2:] == [  # an evaluation names the model it scores
        "evals/lifecycle/base@2026.12.02 (of checkpoints/lifecycle/base@2026.12.02 step 40)",
        "evals/lifecycle/cooldown@2026.12.02 (of checkpoints/lifecycle/cooldown@2026.12.02 "
        "step 20)",
    ]
    curves = repo / "dist/compare/lifecycle/curves.png"
    assert curves.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "of 2 run(s) against step" in compared.stdout
    assert "wrote dist/compare/lifecycle/curves.png" in compared.stdout  # the path written

    supervised_fine_tuning_of_the_run(repo)

    # The run's config changes under its version: the cooldown no longer reads as built.
    build_file = repo / "experiments/lifecycle/BUILD"
    text = build_file.read_text()
    build_file.write_text(text.replace("learning_rate=1e-2, warmup=4", "learning_rate=2e-2, warmup=4"))
    try:
        planned = pants_plan(repo)
    finally:
        build_file.write_text(text)
    assert re.search(r"^\s+drift\s+\S+\s+lm_checkpoint\s+checkpoints/lifecycle/cooldown@", planned,
                     re.MULTILINE), planned  # fmt: skip
    assert "differs in: init_from.fingerprint" in planned

    # A built run is served by `pants run`, whose runner's Python dependency inference builds
    # every target of the repository, the broken one too; the broken one fails where it is read.
    served = pants(repo, "run", "experiments/lifecycle:base")
    assert "checkpoints/lifecycle/base@2026.12.02" in served.stdout + served.stderr
    refused = subprocess.run(pants_command("plan", "experiments/bad_stages:bad"), cwd=repo,
                             capture_output=True, text=True, timeout=300)  # fmt: skip
    assert refused.returncode != 0
    assert ("experiments/bad_stages/BUILD:1: The `datasets` field in target "
            "experiments/bad_stages:bad has stages starting at steps [5]: the first starts at "
            "0") in refused.stderr, refused.stderr[-3000:]  # fmt: skip


def supervised_fine_tuning_of_the_run(repo: Path) -> None:
    """Marin's default_sft: the run's weights, a fresh optimizer, chats from their beginning;
    the loss (train and held-out) counts the assistant's tokens, the share `plan` reports; on
    the held-out chats the fine-tuned model beats the run it started from, side by side."""
    pants(repo, "build", "experiments/lifecycle:sft_family")
    assert (repo / STORE / SFT / "STATUS").read_text().strip() == "SUCCESS"
    parent = read(repo, SFT, "artifact.json")["identity"]["init_from"]
    assert (parent["name"], parent["fingerprint"]) == (
        "checkpoints/lifecycle/base", read(repo, BASE, "artifact.json")["fingerprint"]
    )
    assert not parent.get("optimizer_state") and not parent.get("data_continues")  # weights
    log = (repo / "dist/logs/checkpoints/lifecycle/sft/2026.12.06.log").read_text()
    assert "started from checkpoints/lifecycle/base@2026.12.02" in log
    held_out = "eval/chats_heldout/loss"
    losses = [json.loads(line)[held_out] for line in (repo / STORE / SFT / "metrics.jsonl")
              .read_text().splitlines() if held_out in line]  # fmt: skip
    assert losses[-1] < losses[0], losses  # the held-out answers, from the base's weights on
    scored = {run: read(repo, f"evals/lifecycle/{run}_chats/2026.12.06", "results.json")
              ["metrics"][held_out] for run in ("base", "sft")}  # fmt: skip
    assert scored["sft"] < scored["base"], scored
    compared = pants(repo, "compare", "experiments/lifecycle:sft_family").stdout
    assert "evals/lifecycle/base_chats@2026.12.06 (of checkpoints/lifecycle/base@2026.12.02" \
        in compared and "evals/lifecycle/sft_chats@2026.12.06 (of " in compared, compared
    stats = read(repo, "tokenized/lifecycle/chats/2026.12.06", "stats.json")
    assert 0 < stats["loss_tokens"] < stats["tokens"]
    planned = pants(repo, "plan", "experiments/lifecycle:sft").stdout
    share = f"{stats['loss_tokens'] / stats['tokens']:.0%} masked in"
    assert re.search(rf"tokenized/lifecycle/chats@2026.12.06 .* reads 5.12k tokens \(trains on "
                     rf"~\S+: {share}\)", planned), planned  # fmt: skip

    # Its export carries the chat template: transformers renders a chat as the cache holds it.
    exported = AutoTokenizer.from_pretrained(repo / STORE / "hf/lifecycle/sft/2026.12.06")
    chat = json.loads((repo / "experiments/lifecycle/chats.jsonl").read_text().splitlines()[0])
    cache = TokenCache.open(repo / STORE / "tokenized/lifecycle/chats/2026.12.06")
    rendered = exported.apply_chat_template(chat["messages"], tokenize=True, return_dict=True)
    assert list(rendered["input_ids"]) == cache.document(0).tolist()


def test_the_1b_cooldown_is_planned_beside_its_run(workspace: Path) -> None:
    """experiments:dclm_1b_cooldown, planned on a CPU machine: nothing built, its run first,
    each stage's reads within what the caches will hold (plan exits 0)."""
    planned = pants(workspace, "plan", "experiments:dclm_1b_cooldown").stdout
    lines = planned.splitlines()
    run = next(i for i, line in enumerate(lines) if "checkpoints/dclm_1b_1x@" in line)
    cooldown = next(i for i, line in enumerate(lines) if "checkpoints/dclm_1b_1x_cooldown@" in line)
    assert run < cooldown
    assert "Training data of checkpoints/dclm_1b_1x_cooldown@2026.12.02" in planned
    assert "(from step 0: " in planned and "; from step 7000: " in planned
    assert "!!" not in planned, planned


def pants_plan(repo: Path) -> str:
    """`plan` exits 1 on drift: its output, whatever the exit code."""
    result = subprocess.run(pants_command("plan", "experiments/lifecycle:cooldown"), cwd=repo,
                            capture_output=True, text=True, timeout=900)  # fmt: skip
    return result.stdout
