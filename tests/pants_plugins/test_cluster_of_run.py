"""Where a `pants run` trains decides what this machine builds: on a cluster or from a bundle,
the CPU runtime only and no look for local accelerators (kiln_pants.train_rules)."""

from __future__ import annotations

import pytest

from kiln_pants.train_rules import bundles_run, cluster_of_run


@pytest.mark.parametrize(
    ("option", "args", "cluster"),
    [
        ("", (), ""),
        ("ray://head:10001", (), "ray://head:10001"),
        ("ray://head:10001", ("--cluster", "local"), ""),
        ("", ("--max-steps", "3", "--cluster", "ray://other:10001"), "ray://other:10001"),
        ("", ("--cluster=auto",), "auto"),
        ("ray://a:1", ("--cluster", "ray://b:2", "--cluster", "ray://c:3"), "ray://c:3"),
    ],
)
def test_the_runs_cluster_is_the_last_cluster_flag_else_the_option(
    option: str, args: tuple[str, ...], cluster: str
) -> None:
    assert cluster_of_run(option, args) == cluster


@pytest.mark.parametrize(
    ("args", "bundles"),
    [((), False), (("--bundle", "/tmp/b"), True), (("--bundle=b",), True), (("--max-steps", "3"), False)],
)
def test_a_bundle_run_looks_for_no_accelerators_here(args: tuple[str, ...], bundles: bool) -> None:
    assert bundles_run(args) is bundles
