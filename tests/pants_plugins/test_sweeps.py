"""`lm_sweep(...)`: a grid expands into ordinary lm_checkpoint targets with readable names and
the fingerprints of the same checkpoints written by hand; a bad grid fails as the BUILD file
loads, naming the sweep and the value."""

from __future__ import annotations

import pytest
from pants.base.specs import DirLiteralSpec, RawSpecs
from pants.engine.addresses import Address, Addresses
from pants.engine.internals.scheduler import ExecutionError
from pants.engine.target import Dependencies, DependenciesRequest, Tags, Targets
from pants.testutil.rule_runner import RuleRunner

from kiln_contract.adam import AdamConfig
from kiln_contract.llama import LlamaArchitecture
from kiln_pants.artifact_graph import ArtifactGraph, ArtifactGraphRequest
from kiln_pants.sweeps import SweepError, expand_sweep, short_number
from kiln_pants.target_types import WandbField

CACHE = """
tokenized_cache(name="cache", source="org/data", revision="abc1234", tokenizer="package:gpt2",
                version="2026.06.28")
"""
MODEL = "llama(max_seq_len=128, hidden_dim={d}, intermediate_dim=128, num_heads=4, num_kv_heads=2, num_layers=2)"
BASE = f"""dict(
        model={MODEL.format(d=64)},
        optimizer=adam(learning_rate=1e-3, warmup=10),
        datasets={{":cache": 1.0}},
        validation=[],
        batch_size=8,
        seq_len=128,
        num_train_steps=100,
        z_loss_weight=None,
        evals=None,
        resources=cpu(),
        tags=["small"],
    )"""
SWEEP = f"""
lm_sweep(
    name="lr_sweep",
    version="2026.12.02",
    base={BASE},
    grid={{"model": [{MODEL.format(d=64)}, {MODEL.format(d=128)}], "learning_rate": [1e-3, 3e-3]}},
)
"""
RUNS = ["lr_sweep-d64-lr1e-3", "lr_sweep-d64-lr3e-3", "lr_sweep-d128-lr1e-3", "lr_sweep-d128-lr3e-3"]
BY_HAND = f"""
lm_checkpoint(
    name="by_hand",
    version="2026.12.02",
    model={MODEL.format(d=128)},
    optimizer=adam(learning_rate=3e-3, warmup=10),
    datasets={{":cache": 1.0}},
    validation=[],
    batch_size=8,
    seq_len=128,
    num_train_steps=100,
    z_loss_weight=None,
    evals=None,
    resources=cpu(),
)
"""


def test_a_grid_expands_into_named_checkpoints_with_hand_written_fingerprints(
    rule_runner: RuleRunner,
) -> None:
    rule_runner.write_files({"exp/BUILD": CACHE + SWEEP + BY_HAND})
    sweep = rule_runner.get_target(Address("exp", target_name="lr_sweep"))
    dependencies = rule_runner.request(Addresses, [DependenciesRequest(sweep[Dependencies])])
    assert sorted(a.target_name for a in dependencies) == sorted(RUNS)
    run = rule_runner.get_target(Address("exp", target_name="lr_sweep-d128-lr3e-3"))
    assert run.alias == "lm_checkpoint"
    assert set(run[Tags].value or ()) == {"small", "lr_sweep"}
    assert dict(run[WandbField].value or {}) == {"group": "lr_sweep"}
    graph = rule_runner.request(
        ArtifactGraph,
        [ArtifactGraphRequest(Addresses([Address("exp", target_name=n) for n in ("lr_sweep-d128-lr3e-3", "by_hand")]))],
    )
    swept, by_hand = graph.get(run.address), graph.get(Address("exp", target_name="by_hand"))
    assert swept.fingerprint == by_hand.fingerprint
    assert swept.name == "checkpoints/lr_sweep-d128-lr3e-3" and swept.version == "2026.12.02"


@pytest.mark.parametrize(
    "sweep, expected",
    [
        (
            'grid={"learning_rte": [1e-3]}',
            "lm_sweep 'lr_sweep': the grid names 'learning_rte', which is not a field of "
            "lm_checkpoint, llama(...) or adam(...)",
        ),
        (
            'grid={"learning_rate": [1e-3, 3e-3, 1e-3]}',
            "lm_sweep 'lr_sweep': the point learning_rate=0.001 is listed twice",
        ),
        (
            'grid={"seed": {"a": 1, "b": 1}}',
            "lm_sweep 'lr_sweep': the point seed=1 is listed twice",
        ),
        (
            'zip={"seed": [1, 2], "num_train_steps": [100]}',
            "the `zip` lists differ in length (seed=2, num_train_steps=1)",
        ),
        ('grid={"learning_rate": [-1.0]}', "learning_rate=-1.0: expected a number > 0"),
        # The line of the user's `lm_sweep(`, not of the macro's expansion.
        ('grid={"batch_size": [0]}', "exp/BUILD:4: The `batch_size` field in target exp:lr_sweep-bs0"),
    ],
)
def test_a_bad_grid_fails_where_its_runs_are_read(
    rule_runner: RuleRunner, sweep: str, expected: str
) -> None:
    build = CACHE + f'lm_sweep(name="lr_sweep", version="2026.12.02", base={BASE}, {sweep})\n'
    rule_runner.write_files({"exp/BUILD": build})
    with pytest.raises(ExecutionError) as error:  # as `pants plan exp:` reads every run
        targets = rule_runner.request(Targets, [RawSpecs(dir_literals=(DirLiteralSpec("exp"),),
                                                         description_of_origin="test")])  # fmt: skip
        addresses = Addresses(target.address for target in targets)
        rule_runner.request(ArtifactGraph, [ArtifactGraphRequest(addresses)])
    assert expected in str(error.value)


BASE_FIELDS = {
    "model": LlamaArchitecture(128, 64, 128, 4, 2, 2),
    "optimizer": AdamConfig(learning_rate=1e-3, warmup=10),
    "num_train_steps": 100,
}


def test_zipped_lists_vary_together_and_cross_the_grid() -> None:
    runs = expand_sweep(
        "scaling",
        BASE_FIELDS,
        grid={"seed": [0, 1]},
        zipped={"hidden_dim": [64, 128], "num_train_steps": [100, 400]},
    )
    assert [r.name for r in runs] == [
        "scaling-d64-steps100-seed0", "scaling-d64-steps100-seed1",
        "scaling-d128-steps400-seed0", "scaling-d128-steps400-seed1",
    ]  # fmt: skip
    last = runs[-1].fields
    assert last["model"].hidden_dim == 128 and last["num_train_steps"] == 400
    assert last["seed"] == 1 and last["optimizer"] == BASE_FIELDS["optimizer"]
    assert runs[-1].point == {"hidden_dim": 128, "num_train_steps": 400, "seed": 1}


def test_named_values_and_refusals() -> None:
    [a, b] = expand_sweep("wd", BASE_FIELDS, grid={"weight_decay": {"none": 0.0, "some": 0.1}})
    assert (a.name, b.name) == ("wd-none", "wd-some")
    assert b.fields["optimizer"].weight_decay == 0.1
    with pytest.raises(SweepError, match="`base` gives 'version'; the sweep sets"):
        expand_sweep("x", {**BASE_FIELDS, "version": "2026.12.02"}, grid={"seed": [1]})
    with pytest.raises(SweepError, match="give a `grid` or `zip`"):
        expand_sweep("x", BASE_FIELDS)
    with pytest.raises(SweepError, match="'seed' is in both `grid` and `zip`"):
        expand_sweep("x", BASE_FIELDS, grid={"seed": [1]}, zipped={"seed": [2]})
    with pytest.raises(SweepError, match="cannot name runs after 'datasets'"):
        expand_sweep("x", BASE_FIELDS, grid={"datasets": [{":a": 1.0}]})


@pytest.mark.parametrize(
    "value, text",
    [(3e-3, "3e-3"), (1e-2, "1e-2"), (0.033, "3.3e-2"), (0.5, "0.5"), (400, "400"),
     (400.0, "400"), (1e5, "1e5"), (1.5e-4, "1.5e-4")],
)  # fmt: skip
def test_numbers_in_run_names(value: float, text: str) -> None:
    assert short_number(value) == text
