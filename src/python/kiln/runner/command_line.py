"""The runner's command line: its flags, the run-time overrides they make to the step, and the
step spec, parsed once at the boundary."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

from kiln.runner.errors import StepError
from kiln.train import multihost
from kiln_contract.parsing import SpecError
from kiln_contract.step import StepSpec
from kiln_contract.vocabulary import ATTENTION_IMPLS, REMAT_POLICIES

DESCRIPTION = "Build one lm_checkpoint artifact: Marin's StepRunner for one step."

# Command-line options (argparse dests) -> the step's `runtime` keys they override.
RUNTIME_OVERRIDES = {
    "max_steps": "max_steps_this_run",
    "attention": "attention",
    "gradient_checkpointing": "gradient_checkpointing",
    "validation_every": "validation_every",
    "max_eval_batches": "max_eval_batches",
    "per_device_parallelism": "per_device_parallelism",
    "mesh": "mesh",
}


def apply_overrides(step: StepSpec, args: argparse.Namespace) -> StepSpec:
    """Run-time choices from the command line (`pants run X -- --max-steps 300`)."""
    runtime = {
        key: getattr(args, option)
        for option, key in RUNTIME_OVERRIDES.items()
        if getattr(args, option) is not None
    }
    if args.control_host is not None:
        runtime["control"] = _replace(step.runtime.control, "runtime.control", host=args.control_host)
    config = step.config
    if args.batch_size is not None:
        # Identity changes: only for scratch runs (throughput checks), never into the store.
        if args.output is None:
            raise StepError(
                "--batch-size changes the artifact's identity: give --output DIR as well, so the "
                "run goes to a scratch folder and not to the artifact store"
            )
        config = _replace(config, "config", batch_size=args.batch_size)
    return dataclasses.replace(
        step, runtime=_replace(step.runtime, "runtime", **runtime), config=config
    )


def _replace(value: Any, where: str, **changes: Any) -> Any:
    """`dataclasses.replace`, an invalid value named by its field in the spec."""
    try:
        return dataclasses.replace(value, **changes)
    except SpecError as e:
        raise StepError(f"{e.within(where)} (from the command line)") from None


def argument_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m kiln.runner", description=DESCRIPTION)
    parser.add_argument("step", type=Path, help="the step JSON written by the Pants backend")
    parser.add_argument("--inputs", type=Path, required=True, help="where the built inputs are")
    parser.add_argument(
        "--prefix", help="the artifact store: a directory, s3://BUCKET/PATH or gs://BUCKET/PATH"
    )
    parser.add_argument("--output", type=Path, help="build here instead of the artifact store")
    parser.add_argument(
        "--force",
        action="store_true",
        help="rebuild this version even when built (the old artifact is kept aside until the "
        "new one succeeds)",
    )
    parser.add_argument(
        "--no-wait",
        action="store_true",
        help="refuse at once, instead of waiting, when another run is building the artifact",
    )
    parser.add_argument(
        "--bundle",
        type=Path,
        metavar="DIR",
        help="train nowhere: write the step, its inputs and Kiln's sources to DIR, for a "
        "machine without Pants (a TPU VM), and print the command that trains there",
    )
    parser.add_argument(
        "--library-output",
        action="store_true",
        help="show the libraries' own progress bars (lm-eval's, datasets'), off by default",
    )
    _add_overrides(parser.add_argument_group("run-time overrides (not part of the identity)"))
    multihost.add_flags(parser)
    _add_cluster_flags(parser.add_argument_group("clusters (docs/clusters.md)"))
    return parser


def _add_overrides(overrides: argparse._ArgumentGroup) -> None:
    overrides.add_argument("--max-steps", type=int, help="stop after N steps this run (resumable)")
    overrides.add_argument("--attention", choices=ATTENTION_IMPLS)
    overrides.add_argument("--gradient-checkpointing", choices=REMAT_POLICIES)
    overrides.add_argument("--validation-every", type=int)
    overrides.add_argument(
        "--max-eval-batches", type=int, help="validate on at most N batches of each set"
    )
    overrides.add_argument(
        "--mesh",
        type=_mesh_sizes,
        help="device mesh as AXIS=SIZE,... over data, fsdp, tensor (one may be -1), e.g. data=-1",
    )
    overrides.add_argument(
        "--per-device-parallelism",
        type=int,
        help="sequences per device per forward/backward; fewer accumulates gradients",
    )
    overrides.add_argument(
        "--batch-size", type=int, help="scratch runs only (needs --output): throughput checks"
    )
    overrides.add_argument(
        "--control-host",
        metavar="ADDRESS",
        help="where the control endpoint listens (default 127.0.0.1; 0.0.0.0: every interface, "
        "same tokens, no TLS)",
    )


def _add_cluster_flags(cluster: argparse._ArgumentGroup) -> None:
    cluster.add_argument(
        "--cluster",
        metavar="ray://HOST:PORT|HOST:PORT|auto|local",
        help="train on this Ray cluster (auto: RAY_ADDRESS; local: here)",
    )
    cluster.add_argument(
        "--max-retries",
        type=int,
        default=3,
        help="attempts after a lost host, each from the newest checkpoint",
    )
    cluster.add_argument(
        "--detach", action="store_true", help="print the job's id and return; the job trains on"
    )
    cluster.add_argument(
        "--job", help="set by kiln.cluster on its hosts: the cluster job's id, for the record"
    )
    cluster.add_argument(
        "--staging",
        type=Path,
        help="set by kiln.cluster on its hosts: where a run in a bucket stages its files",
    )


def _mesh_sizes(text: str) -> dict[str, int]:
    """'data=2,fsdp=-1' -> {"data": 2, "fsdp": -1}; the spec checks axes and sizes."""
    try:
        return {axis.strip(): int(size) for axis, size in (p.split("=") for p in text.split(","))}
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected AXIS=SIZE pairs separated by commas, e.g. data=2,fsdp=-1"
        ) from None


def read_step(path: Path) -> StepSpec:
    """The step spec in the file at `path`, parsed once: the runner's boundary."""
    try:
        return StepSpec.from_json(json.loads(path.read_text()))
    except OSError as e:
        raise StepError(f"cannot read the step spec {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise StepError(f"{path} is not valid JSON: {e}") from None
    except SpecError as e:
        raise StepError(f"{path}: {e}") from None
