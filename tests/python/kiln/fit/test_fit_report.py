"""kiln.fit without a compiler: the remedies' order and BUILD fields, the compiler's refusals
read, the report's table. (The compile itself, for a multi-chip slice, is in
tests/e2e/test_fit_check.py, through `pants plan --fit`.)"""

from __future__ import annotations

from kiln.fit.choices import Choice, build_text, remedies
from kiln.fit.compile import GIB, Compiled, Memory, is_out_of_memory, refusal_numbers
from kiln.fit.report import report_json, table_lines

FSDP = {"data": 1, "fsdp": -1, "tensor": 1}


def test_the_compilers_refusal_is_read() -> None:
    new = (
        "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
        "temporaries (16.20G) exceeds available HBM (15.75G). HLO module: jit_train_step."
    )
    old = "Ran out of memory in memory space hbm. Used 20.51G of 15.48G hbm. Exceeded by 5.03G"
    assert is_out_of_memory(new) and is_out_of_memory(old)
    assert refusal_numbers(new) == (int(16.20 * GIB), int(15.75 * GIB))
    assert refusal_numbers(old) == (int(20.51 * GIB), int(15.48 * GIB))
    assert not is_out_of_memory("ValueError: mesh {'tensor': 3} needs a multiple of 3 devices")
    assert refusal_numbers("something else") == (None, None)


def test_remedies_come_cheapest_first_and_name_their_build_fields() -> None:
    # The 1.4B run's choice on 16 chips: 256 x 2048, 8 sequences a pass, save_dots.
    declared = Choice(FSDP, 8, "save_dots")
    found = remedies(declared, batch_size=256, seq_len=2048, chips=16, num_heads=16,
                     num_kv_heads=16)  # fmt: skip
    fields = [build_text(c.build_fields(declared)) for c in found]
    # Fewer sequences a pass first (the same FLOPs), then splits of the heads, then full remat
    # (the forward again: a third more compute).
    assert fields[0] == "per_device_parallelism=4"
    assert fields.index('mesh={"fsdp": -1, "tensor": 2}') < fields.index(
        'gradient_checkpointing="full"'
    )
    costs = [c.cost(declared, 256, 2048, 16) for c in found]
    assert costs == sorted(costs) and costs[0] >= 1.0
    # Every remedy holds no more of a pass a chip than the declared one, and divides the batch.
    for choice in found:
        rows = choice.rows_per_pass(256, 16)
        assert rows / choice.sizes(16)["tensor"] <= 8
        assert 256 % (rows * choice.batch_ways(16)) == 0
    assert declared.key() not in {c.key() for c in found}


def test_replicated_state_is_sharded_first() -> None:
    declared = Choice({"data": 2, "fsdp": 2, "tensor": 1}, None, "none")
    first = remedies(declared, batch_size=8, seq_len=128, chips=4, num_heads=4, num_kv_heads=2)[0]
    assert build_text(first.build_fields(declared)) == 'mesh={"fsdp": -1}'


class _Step:
    name, version, fingerprint = "checkpoints/x", "v1", "abc"

    class config:  # noqa: N801 - stands in for a TrainConfig
        batch_size, seq_len = 256, 2048


def _compiled(choice: Choice, status: str, peak_gib: float | None, **fields: object) -> Compiled:
    memory = None
    if peak_gib is not None:
        memory = Memory(arguments=int(6 * GIB), outputs=int(6 * GIB), alias=int(6 * GIB),
                        temporaries=int((peak_gib - 6) * GIB), host_temporaries=0)  # fmt: skip
    values = dict(choice=choice, status=status, state=int(5.9 * GIB), parameters_bytes=int(GIB),
                  memory=memory, required=None, limit=int(15.75 * GIB), message="",
                  seconds=99.0, attention="pallas")  # fmt: skip
    values.update(fields)
    return Compiled(**values)  # type: ignore[arg-type]


def test_a_refused_step_names_the_cheapest_remedy_that_fits() -> None:
    declared = Choice(FSDP, 8, "save_dots")
    refused = _compiled(
        declared, "does not fit", None, required=int(16.2 * GIB),
        message="Ran out of memory on HBM, the total memory required for HLO temporaries "
        "(16.20G) exceeds available HBM (15.75G).",
    )  # fmt: skip
    still = _compiled(Choice(FSDP, 4, "save_dots"), "does not fit", 16.5)
    fitting = _compiled(Choice(FSDP, 2, "save_dots"), "fits", 12.25)
    report = report_json(
        step=_Step, target={"slice": "v5e-16", "topology": "v5e:4x4", "chips": 16,
                            "device_kind": "TPU v5 lite", "chip_config_name": None,
                            "hbm_bytes": int(15.75 * GIB), "hbm_source": "the compiler's"},
        model={"parameters": 2_136_049_664, "vocab_size": 128_256}, declared=refused,
        variants=[still, fitting], versions={"jax": "0.11.2", "libtpu": "0.0.48.1"},
        choice=declared, chips=16,
    )  # fmt: skip
    assert report["fits"] is False and report["status"] == "does not fit"
    assert report["declared"]["required_bytes"] == int(16.2 * GIB)
    assert report["suggestion"]["build_fields"] == {"per_device_parallelism": 2}
    text = "\n".join(table_lines(report))
    assert "v5e-16: v5e:4x4, 16 x TPU v5 lite, 15.75 GiB HBM a chip" in text
    assert "needs 16.20" in text
    assert "does not fit: the compiler needs 16.20 GiB of temporaries beside 5.90 GiB of " in text
    assert "(\"Ran out of memory on HBM, the total memory required" in text
    assert "fits with: per_device_parallelism=2 (peak 12.25 GiB a chip" in text


def test_a_fitting_step_says_its_share_of_the_chip() -> None:
    declared = Choice(FSDP, None, "none")
    report = report_json(
        step=_Step, target={"slice": "v4-128", "topology": "v4:4x4x4", "chips": 64,
                            "device_kind": "TPU v4", "chip_config_name": "megacore",
                            "hbm_bytes": int(30.75 * GIB), "hbm_source": "the compiler's"},
        model={"parameters": 10, "vocab_size": 10}, declared=_compiled(declared, "fits", 8.1, limit=int(30.75 * GIB)),
        variants=[], versions={"jax": "0.11.2"}, choice=declared, chips=64,
    )  # fmt: skip
    assert report["fits"] and report["suggestion"] is None and report["variants"] == []
    text = "\n".join(table_lines(report))
    assert "64 x TPU v4 (megacore), 30.75 GiB HBM a chip" in text
    assert "fits: peak 8.10 of 30.75 GiB a chip (26%)" in text
