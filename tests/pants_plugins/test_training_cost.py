"""`pants plan`'s training cost: parameters, tokens and FLOPs by the stated formula, device-hours
only from measured throughput (and money from `[kiln] price_per_device_hour`), "unknown" where
no measurement covers a run; the wall time with the measured start-up and the caches' share."""

from __future__ import annotations

import json
import re
from pathlib import Path

from pants.engine.addresses import Address
from pants.testutil.rule_runner import RuleRunner

from kiln_contract.llama import LlamaArchitecture, flops_per_token, num_parameters
from kiln_contract.train import Resources
from kiln_pants.artifact_graph import Artifact
from kiln_pants.cache_estimate import duration
from kiln_pants.plan import Plan
from kiln_pants.training_cost import (
    INPUT_CACHES_SECTION,
    MEASURED_START_UP,
    MEASURED_THROUGHPUT,
    SECONDS_PER_INPUT_CACHE,
    measurement_for,
    run_cost,
    vocabulary_size,
)

ONE_POINT_FOUR_B = LlamaArchitecture(max_seq_len=4096, hidden_dim=2048, intermediate_dim=8192,
                                     num_heads=16, num_kv_heads=16, num_layers=24)  # fmt: skip


def test_the_counts_by_hand() -> None:
    # benchmarks/RESULTS.md: the 1.4B Llama with Llama-3's vocabulary, untied, has 2.14B.
    assert round(num_parameters(ONE_POINT_FOUR_B, 128256) / 1e9, 2) == 2.14
    small = LlamaArchitecture(max_seq_len=64, hidden_dim=32, intermediate_dim=64, num_heads=2,
                              num_kv_heads=1, num_layers=1)  # fmt: skip
    matmuls = (32 * 32 + 2 * 32 * 16 + 32 * 32) + 3 * 32 * 64 + 100 * 32  # q k v o, mlp, head
    assert flops_per_token(small, 100, 64) == 6 * matmuls + 12 * 1 * 64 * 2 * 16


def test_a_run_is_priced_only_from_a_measurement_that_covers_it() -> None:
    h200 = next(m for m in MEASURED_THROUGHPUT if m.device == "H200")
    assert measurement_for("H200", "bfloat16", 3_000_000_000) == (h200, "")
    assert measurement_for("H100", "bfloat16", 2_000_000_000)[1] == (
        "no throughput measured on H100 (measured: H200, cpu, v5litepod)"
    )
    assert measurement_for("H200", "float32", 2_000_000_000)[1] == (
        "no float32 throughput measured on H200"
    )
    assert measurement_for("H200", "bfloat16", 7_000_000_000)[1] == (
        "no bfloat16 measurement on H200 within 3x of 7.00B parameters (measured: 2.14B)"
    )


def test_the_plugins_measurements_are_the_rows_of_results_md() -> None:
    text = Path("benchmarks/RESULTS.md").read_text()
    section = text.split("## Training throughput per device")[1].split("\n## ")[0]
    rows = [
        [cell.strip() for cell in line.strip("|").split("|")]
        for line in section.splitlines()
        if line.startswith("| ") and not line.startswith("| model")
    ]
    assert [(r[2], r[3], int(r[4]), int(r[5].replace(",", "")), r[6], r[7]) for r in rows] == [
        (m.device, m.compute_dtype, m.seq_len, m.tokens_per_second, m.date, m.section)
        for m in MEASURED_THROUGHPUT
    ]
    for measurement in MEASURED_THROUGHPUT:  # the section it cites exists
        assert re.search(rf"^##+ {re.escape(measurement.section)}\b", text, re.MULTILINE)


def test_a_training_of_a_thousand_caches_pays_for_each() -> None:
    """benchmarks/graph_scale.py's checkpoint: 1,000 one-document caches, one of them also its
    validation set; its steps take seconds, its caches more."""
    caches = tuple(Address("scale/caches", target_name=f"c{i}") for i in range(1000))
    model = LlamaArchitecture(max_seq_len=64, hidden_dim=32, intermediate_dim=64, num_heads=2,
                              num_kv_heads=1, num_layers=1)  # fmt: skip
    identity = {"model": model.to_json(), "batch_size": 4, "seq_len": 64, "num_train_steps": 20,
                "compute_dtype": "float32"}  # fmt: skip
    checkpoint = Artifact(Address("scale", target_name="big"), "lm_checkpoint", "checkpoints/scale",
                          "2026.12.02", json.dumps(identity), "0" * 16, (*caches, caches[0]))  # fmt: skip
    cost = run_cost(checkpoint, Resources("cpu"), 8192)
    assert cost.caches == 1000
    [start] = MEASURED_START_UP
    steps = cost.step_hours
    assert steps is not None and cost.device_hours == steps  # one cpu device
    caches_seconds = 1000 * SECONDS_PER_INPUT_CACHE
    assert cost.wall_hours == steps + (start.seconds + caches_seconds) / 3600
    assert f"  + {duration(caches_seconds / 3600)}: 1,000 input cache(s) opened, checked and " \
        f"placed, {SECONDS_PER_INPUT_CACHE:g} s each (benchmarks/RESULTS.md, " \
        f"\"{INPUT_CACHES_SECTION}\")" in cost.wall_lines()
    priced = cost.to_json({})
    assert (priced["input_caches"], priced["caches_seconds"], priced["start_up_seconds"]) == (
        1000, caches_seconds, start.seconds)  # fmt: skip
    assert priced["wall_hours"] == cost.wall_hours


def test_the_caches_figure_is_the_row_of_results_md() -> None:
    text = Path("benchmarks/RESULTS.md").read_text()
    section = text.split(f"## {INPUT_CACHES_SECTION}")[1].split("\n## ")[0]
    assert f"**{SECONDS_PER_INPUT_CACHE:g} s per cache**" in section


def test_a_tokenizer_json_gives_its_vocabulary() -> None:
    tokenizer = {"model": {"vocab": {"a": 0, "b": 1, "c": 2}},
                 "added_tokens": [{"id": 3, "content": "<eos>"}]}  # fmt: skip
    assert vocabulary_size(tokenizer) == 4
    assert vocabulary_size({"model": {"vocab": [["a", 0.0], ["b", 0.0]]}}) == 2  # unigram
    assert vocabulary_size({}) is None
    assert vocabulary_size({"model": "fake"}) is None  # not a tokenizers file: unknown


# The quickstart's vocabulary size: its row of MEASURED_THROUGHPUT prices the runs.
TOKENIZER = {"model": {"vocab": {f"t{i}": i for i in range(8191)}},
             "added_tokens": [{"id": 8191, "content": "<eos>"}]}  # fmt: skip
SWEEP = """
tokenized_cache(name="cache", source="org/data", revision="abc1234", tokenizer=TOKENIZER,
                version="2026.06.28")
files(name="tok", sources=["tok/tokenizer.json"])
lm_sweep(
    name="sweep",
    version="2026.12.02",
    base=dict(
        model=llama(max_seq_len=128, hidden_dim=128, intermediate_dim=512, num_heads=4,
                    num_kv_heads=2, num_layers=2),
        optimizer=adam(learning_rate=1e-3, warmup=10),
        datasets={":cache": 1.0}, validation=[], batch_size=16, seq_len=128,
        num_train_steps=100, z_loss_weight=None, evals=None, resources=RESOURCES,
        compute_dtype="float32",
    ),
    grid={"learning_rate": [1e-3, 3e-3]},
)
"""


def test_plan_prices_each_run_and_the_sweep(plan_rule_runner: RuleRunner, tmp_path: Path) -> None:
    rule_runner = plan_rule_runner
    build = SWEEP.replace("TOKENIZER", '"//exp:tok"').replace("RESOURCES", "cpu()")
    rule_runner.write_files({"exp/BUILD": build, "exp/tok/tokenizer.json": json.dumps(TOKENIZER)})
    args = [f"--kiln-prefix={tmp_path}", "--kiln-price-per-device-hour={'cpu': 2.0}", "exp:sweep"]
    result = rule_runner.run_goal_rule(Plan, args=args)
    assert result.exit_code == 0, result.stderr
    vocab = 8192
    model = LlamaArchitecture(128, 128, 512, 4, 2, 2)
    tokens = 16 * 128 * 100
    flops = tokens * flops_per_token(model, vocab, 128)
    quickstart = next(m for m in MEASURED_THROUGHPUT if m.section == "Quickstart")
    hours = flops / quickstart.flops_per_second / 3600
    line = (
        f"checkpoints/sweep-lr1e-3@2026.12.02: {num_parameters(model, vocab) / 1e6:.2f}M "
        f"parameters, 204.80k tokens, {flops:.3g} FLOPs"
    )
    assert line.replace("e+", "e") in result.stdout
    assert f"{hours:.3g} cpu device-hours (steps: {duration(hours)} on 1 device(s))" in result.stdout
    assert f"; {hours * 2.0:,.2f} at 2 per device-hour" in result.stdout
    [start] = MEASURED_START_UP  # wall time: the steps, the measured start, the one cache
    wall = (
        f"      wall ~ {duration(hours + (start.seconds + SECONDS_PER_INPUT_CACHE) / 3600)} (the "
        "runtime's build and the evaluations not included):\n"
        f"        {duration(hours)} of steps\n"
        f"        + {start.seconds:g} s to the first step (start-up and compile, measured on cpu "
        f"{start.date}, benchmarks/RESULTS.md, \"{start.section}\")\n"
        f"        + {SECONDS_PER_INPUT_CACHE:.2g} s: 1 input cache(s) opened, checked and placed"
    )
    assert wall in result.stdout
    assert "Total of 2 run(s): 409.60k tokens" in result.stdout
    assert f"  {2 * hours:.3g} cpu device-hours; {4 * hours:,.2f} at 2" in result.stdout


def test_plan_says_when_no_measurement_covers_a_run(
    plan_rule_runner: RuleRunner, tmp_path: Path
) -> None:
    # GPT-2's known vocabulary makes the model 13.36M parameters: no cpu row within 3x.
    build = SWEEP.replace("TOKENIZER", '"package:gpt2"').replace("RESOURCES", "cpu()")
    plan_rule_runner.write_files({"exp/BUILD": build})
    result = plan_rule_runner.run_goal_rule(Plan, args=[f"--kiln-prefix={tmp_path}", "exp:sweep"])
    assert "checkpoints/sweep-lr3e-3@2026.12.02: 13.36M parameters" in result.stdout
    assert (
        "device-hours unknown: no float32 measurement on cpu within 3x of 13.36M parameters "
        "(measured: 754.30k, 2.59M)"
    ) in result.stdout
    assert "2 run(s) not priced: no measurement covers them" in result.stdout
    assert "cpu device-hours" not in result.stdout


def test_a_tpu_chip_without_a_measurement_is_priced_at_the_v5es_mfu() -> None:
    """The v5e rows carry the MFU RESULTS reports (57.6%, 67.8%, 53.8% of 197 TFLOP/s); the
    reference's 1.4B run on a v4-128 is priced at the 1.0B row's MFU on the v4's 275 TFLOP/s
    peak, across its 64 chips, and says it is an estimate."""
    v5e = [m for m in MEASURED_THROUGHPUT if m.device == "v5litepod"]
    assert [round(m.mfu, 3) for m in v5e] == [0.576, 0.678, 0.538]
    identity = {"model": ONE_POINT_FOUR_B.to_json(), "batch_size": 256, "seq_len": 2048,
                "num_train_steps": 1000, "compute_dtype": "bfloat16"}  # fmt: skip
    checkpoint = Artifact(Address("exp", target_name="dclm"), "lm_checkpoint", "checkpoints/dclm",
                          "2026.12.07", json.dumps(identity), "f" * 16, ())  # fmt: skip
    cost = run_cost(checkpoint, Resources(kind="tpu", type="v4-128"), 128256)
    assert cost.estimated and cost.measurement == v5e[2] and cost.device == "v4"
    flops = 256 * 2048 * 1000 * flops_per_token(ONE_POINT_FOUR_B, 128256, 2048)
    assert cost.device_hours == flops / (v5e[2].mfu * 275e12) / 3600
    assert cost.step_hours == cost.device_hours / 64
    described = "\n".join(cost.describe({}))
    assert f"~{cost.device_hours:.3g} v4 device-hours (steps: " in described
    assert "an estimate: v4's peak 275 TFLOP/s bf16 at the 53.8% MFU of" in described
    assert cost.to_json({})["estimated_from"] == "v5litepod"
    on_v5e = run_cost(checkpoint, Resources(kind="tpu", type="v5litepod-16"), 128256)
    assert not on_v5e.estimated and on_v5e.step_hours == on_v5e.device_hours / 16
