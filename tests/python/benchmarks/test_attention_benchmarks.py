"""The attention benchmark scripts run end to end in CPU interpret mode (--quick), with the table's
settings or a settings file (a tuner's JSON). The GPU numbers themselves are in
benchmarks/RESULTS.md."""

import json

import attention
import attention_once
import pytest

from kiln.kernels.block_sizes import BlockSizes, LaunchParams

SETTINGS = {  # a tuner's --json: a flat dict of fields per head dim
    "device_kind": "cpu",
    "64": {"block_q": 32, "block_kv": 32, "num_warps_fwd": 8, "fused_dq": True},
}


def test_a_settings_file_feeds_the_benchmarks(tmp_path, capsys):
    settings_path, rows_path = tmp_path / "tuned.json", tmp_path / "rows.json"
    settings_path.write_text(json.dumps(SETTINGS))
    assert attention.load_block_sizes(str(settings_path)) == {
        64: (BlockSizes(block_q=32, block_kv=32), LaunchParams(num_warps_fwd=8, fused_dq=True))
    }

    # The profiling script takes the same file (device_check.sh profiles the tuned layout).
    once = ["--seq-len", "128", "--head-dim", "64", "--tokens", "128", "--model-dim", "128"]
    attention_once.main([*once, "--block-sizes", str(settings_path)])
    assert "ran fwd+bwd once: (1, 128, 2, 64)" in capsys.readouterr().out

    # Causal rows only: this checks the script (layouts, passes, settings); the kernel's
    # non-causal path is checked in tests/python/kiln/kernels.
    quick = ["--quick", "--causal", "true", "--block-sizes", str(settings_path)]
    attention.main([*quick, "--json", str(rows_path)])
    assert "fused_dq=True" in capsys.readouterr().out  # the settings it ran with
    rows = json.loads(rows_path.read_text())
    assert {(row["config"]["layout"], row["pass"]) for row in rows} == {
        (layout, pass_name) for layout in ("none", "ones", "docs") for pass_name in ("fwd", "fwd+bwd")
    }
    for row in rows:
        ours = row["results"][0]
        assert ours["implementation"] == "ours" and ours["seconds"] > 0
        assert ours["error"] < 3e-2, row  # bf16 against the fp32 reference


def test_a_settings_file_naming_another_field_is_refused(tmp_path):
    path = tmp_path / "tuned.json"
    path.write_text(json.dumps({"64": {"block_q": 64, "hopper_forward": True}}))
    with pytest.raises(ValueError, match=r"tuned.json: hopper_forward: not a BlockSizes or Launch"):
        attention.load_block_sizes(str(path))


def test_the_profiling_script_runs_at_a_small_size(capsys):
    attention_once.main(
        ["--seq-len", "64", "--head-dim", "64", "--tokens", "64", "--model-dim", "128"]
    )
    assert "ran fwd+bwd once: (1, 64, 2, 64)" in capsys.readouterr().out
