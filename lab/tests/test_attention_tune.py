"""The tuner runs end to end in CPU interpret mode (--quick), the Hopper kernels' stages
included, and what it writes is usable: with no Hopper switch on, its JSON is a settings file
that benchmarks/attention.py reads back. Its parts: dropping candidates, the stages' own
processes, the reference check, and how it combines the fastest kernels."""

import dataclasses
import json
import math
import re
import types

import attention

from kiln.kernels.block_sizes import BlockSizes, LaunchParams
from kiln_lab import attention_tune, layouts

DEFAULT = layouts.fields_of(BlockSizes(), LaunchParams())
SMALL = {**DEFAULT, "block_q": 32, "block_kv": 32}


def test_tuner_output_feeds_the_attention_table(tmp_path, capfd):
    """capfd: the Hopper stages' rows come from their own processes."""
    tuned_path = tmp_path / "tuned.json"
    attention_tune.main(["--quick", "--json", str(tuned_path)])
    tuned = json.loads(tuned_path.read_text())
    assert tuned["device_kind"] == "cpu"
    assert not any(name.startswith("hopper_") for name in tuned["64"])  # none won on a CPU
    settings = attention.load_block_sizes(str(tuned_path))
    assert set(settings) == {64} and isinstance(settings[64][0], BlockSizes)
    output = capfd.readouterr().out
    assert "tuned d=64" in output and "backward: dK/dV + dQ" in output
    for kernel in ("fwd", "dkv", "dq"):  # each Triton kernel against its Hopper one
        assert f"  {kernel}: triton " in output
    assert output.count("hopper (mosaic gpu)") == 3
    for kernel in ("hopper", "hopper_dkv", "hopper_dq"):  # each one's rows, from its process
        assert f"  {kernel:<10} 64,64,3 " in output
    # Every candidate of every kernel (the Hopper kernels and the fused backward included)
    # matched the fp32 reference.
    assert "rejected" not in output and "failed" not in output, output


def test_candidates_that_fail_or_miss_the_error_cap_are_dropped(capsys):
    problem = attention_tune.Problem(seq_len=64, head_dim=64, causal=True, batch=1, num_heads=1)
    bench = attention_tune.KernelBench(problem, attention_tune.jnp.bfloat16, interpret=True)
    options = attention_tune.parse_args(["--quick"])
    options.max_candidates = 10
    base = SMALL
    candidates = [(48, 64, 4, 2), (16, 64, 4, 2)]  # 48 is not a power of two: ValueError

    found = []  # Each new fastest as it is found (a Hopper stage's process writes them out).
    best, seconds = attention_tune.tune_kernel(
        bench, "fwd", base, options, candidates, on_best=lambda *a: found.append(a)
    )
    output = capsys.readouterr().out
    assert "48,64,4,2        failed: ValueError" in output
    assert (best["block_q"], best["block_kv"]) in {(32, 32), (16, 64)}
    assert found[0][0] == base and found[-1] == (best, seconds)

    options.max_error = -1.0  # nothing passes: the base setting is kept
    assert attention_tune.tune_kernel(bench, "fwd", base, options, candidates) == (base, math.inf)
    assert capsys.readouterr().out.count("rejected: out ") == 2  # names the outputs off

    # --triton-candidates 1: the table's setting alone, as a baseline.
    options.max_error, options.triton_candidates = 5e-2, 1
    best, seconds = attention_tune.tune_kernel(bench, "fwd", base, options, candidates)
    assert capsys.readouterr().out.count("  fwd ") == 1
    assert best == base and math.isfinite(seconds)


def test_a_hopper_stage_that_hangs_or_crashes_costs_its_own_stage_only(capfd):
    """tune_in_child: a child past --stage-timeout is killed, one that dies is reported, and the
    base setting comes back with no time, for tune() to go on with the next stage."""
    problem = attention_tune.Problem(seq_len=128, head_dim=64, causal=True, batch=1, num_heads=2)
    options = attention_tune.parse_args(["--quick"])
    base = DEFAULT

    options.stage_timeout = 1.0  # Importing jax alone takes longer.
    bench = types.SimpleNamespace(problem=problem)
    assert attention_tune.tune_in_child(bench, "hopper", base, options) == (base, math.inf)
    assert "hopper: stopped after 1 s, no candidate passed before" in capfd.readouterr().out

    options.stage_timeout = 120.0
    bench.problem = dataclasses.replace(problem, seq_len=100)  # No tile divides it: it fails.
    assert attention_tune.tune_in_child(bench, "hopper", base, options) == (base, math.inf)
    output = capfd.readouterr()
    assert "hopper: its process exited with 1, no candidate passed before" in output.out
    assert "pick a seq_len the tiles divide" in output.err


def test_a_failure_is_one_line_with_the_start_and_the_end_of_its_message():
    message = "lowering context\n" * 200 + "ptxas fatal: out of registers"
    text = attention_tune.failure(RuntimeError(message))
    assert text.startswith("RuntimeError: lowering context | lowering context")
    assert text.endswith("ptxas fatal: out of registers") and "\n" not in text
    assert len(text) <= 300 + 5 + 700
    assert attention_tune.failure(ValueError("short")) == "ValueError: short"


def test_the_reference_check_covers_the_last_batch_row_and_head_and_locates_errors():
    problem = attention_tune.Problem(seq_len=192, head_dim=64, causal=True, batch=2, num_heads=3)
    bench = attention_tune.KernelBench(problem, attention_tune.jnp.bfloat16, interpret=True)
    fn, args = bench.kernel("fwd", SMALL)
    out = fn(*args)
    assert bench.errors("fwd", out)["out"] < 1e-2
    assert bench.off_tiles("fwd", out, 5e-2) == {}
    wrong = out.at[-1, 64:, -1].set(0)  # The last batch row's last head, tiles 1 and 2 of 3.
    assert bench.errors("fwd", wrong)["out"] > 0.1
    assert bench.off_tiles("fwd", wrong, 5e-2) == {"out": "[-1,-1] 1-2 of 3"}
    wrong = out.at[0, 0, 1:].set(float("nan"))  # Head 1 is not checked; the last head is.
    assert bench.off_tiles("fwd", wrong, 5e-2) == {"out": "[0,-1] 0 of 3"}
    assert attention_tune.spans([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"


def test_context_rows_time_ours_and_report_what_cannot_run_here(capsys):
    problem = attention_tune.Problem(seq_len=64, head_dim=64, causal=True, batch=1, num_heads=2)
    bench = attention_tune.KernelBench(problem, attention_tune.jnp.bfloat16, interpret=True)
    options = attention_tune.parse_args(["--quick"])
    options.tuned = DEFAULT
    attention_tune.context_rows(bench, options)
    output = capsys.readouterr().out
    assert "ours (tuned) fwd+bwd" in output
    assert not re.search(r"ours \(tuned\) fwd\+bwd +failed", output), output
    assert re.search(r"cudnn fwd\+bwd +failed", output)  # no GPU here: a row, not a crash
    # A GPU-only kernel; where jax's test utilities lack absl (this test's resolve), not built.
    assert re.search(r"jax mosaic gpu \(fp16\) fwd +failed|jax mosaic gpu: No module", output)


def test_the_hopper_fused_backward_stage_checks_its_candidates(capsys):
    """The Hopper fused backward needs head dim 128, which --quick (d=64) skips: its tuner stage
    on a small d=128 problem, interpreted, against the fp32 reference (dQ unscaled), with pT
    rounded to bf16 and kept in fp32."""
    problem = attention_tune.Problem(seq_len=128, head_dim=128, causal=True, batch=1, num_heads=2)
    bench = attention_tune.KernelBench(problem, attention_tune.jnp.bfloat16, interpret=True)
    options = attention_tune.parse_args(["--quick"])
    base = SMALL

    candidates = [(64, 64, 2, False), (64, 64, 2, True)]
    best, seconds = attention_tune.tune_kernel(bench, "hopper_fused", base, options, candidates)
    output = capsys.readouterr().out
    assert "hopper_fused 64,64,2,False" in output and "64,64,2,True" in output, output
    assert "rejected" not in output and "failed" not in output, output
    assert best["hopper_dkv"] and best["fused_dq"] and not best["hopper_dq"]
    assert math.isfinite(seconds)


def test_the_tuner_combines_the_fastest_kernels_into_a_valid_layout(monkeypatch):
    """tune()'s choices, with each stage's time given: the Hopper fused backward beats the
    Triton one and dK/dV + dQ (even with the Hopper dQ faster than the Triton one), so the
    layout is the fused one and the Hopper dQ switch stays off (the two exclude each other).
    Then, tuned again from that layout, the split one wins: the fused kernel's own settings
    are reset with it."""
    times = {"fwd": 1.0, "dkv": 2.0, "dq": 2.0, "fused": 3.0, "hopper": 0.5}
    times |= {"hopper_dkv": 2.5, "hopper_dq": 1.5, "hopper_fused": 2.5}

    def fake_tune_kernel(bench, kernel, base, options, candidates=None):
        last = layouts.CANDIDATES[kernel][-1]  # the fused one's: pT in fp32
        fields = dict(zip(layouts.FIELDS[kernel], last), **layouts.LAYOUT[kernel])
        return {**base, **fields}, times[kernel]

    monkeypatch.setattr(attention_tune, "tune_kernel", fake_tune_kernel)
    monkeypatch.setattr(attention_tune, "tune_in_child", fake_tune_kernel)
    problem = attention_tune.Problem(seq_len=128, head_dim=128, causal=True, batch=1, num_heads=1)
    bench = types.SimpleNamespace(problem=problem)
    updates = []
    fields = attention_tune.tune(bench, DEFAULT, None, updates.append)
    assert fields["hopper_forward"] and fields["hopper_dkv"] and fields["fused_dq"]
    assert not fields["hopper_dq"]
    assert (fields["block_q_dkv"], fields["block_kv_dkv"], fields["num_stages_dkv"]) == (64, 64, 3)
    assert fields["hopper_fused_fp32_probs"]
    assert updates[-1] == fields
    layouts.settings(fields)  # a valid layout

    # Both fused backwards slower than the Triton dK/dV + the Hopper dQ (2.0 + 1.5):
    times["fused"] = times["hopper_fused"] = 4.0
    fields = attention_tune.tune(bench, fields, None, updates.append)
    assert fields["hopper_dq"] and not fields["fused_dq"] and not fields["hopper_dkv"]
    assert not fields["hopper_fused_fp32_probs"]
    layouts.settings(fields)
