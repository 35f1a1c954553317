"""`python -m kiln.fit STEP.json --vocab-size V [--target SLICE] [--variants N] [--json OUT]`:
does the step fit its TPU slice? (kiln.fit; `pants plan --fit` runs it.)

Prints the table; `--json OUT` also writes the report as one JSON object. Exits 0 whether or
not the step fits (the report says); 1 when it cannot check (a bad step, an unknown slice).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

# The compiler's mock devices need libtpu, not a TPU: jax runs on its CPU backend here, never
# on a device; libtpu's one-process-a-machine lock (/tmp/libtpu_lockfile, for the devices) is
# not taken, so that checks run side by side (Pants runs one per training at once); and its
# start-up is told it is on no TPU VM (its warnings otherwise fill the output).
FORCED = {"JAX_PLATFORMS": "cpu", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
QUIET_LIBTPU = {
    "TPU_ACCELERATOR_TYPE": "",
    "TPU_WORKER_HOSTNAMES": "localhost",
    "TPU_SKIP_MDS_QUERY": "1",
    "TF_CPP_MIN_LOG_LEVEL": "2",
}
DEFAULT_VARIANTS = 6


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.update(FORCED)  # whatever the machine has
    for name, value in QUIET_LIBTPU.items():
        os.environ.setdefault(name, value)
    from kiln_contract.parsing import SpecError
    from kiln_contract.step import StepSpec
    from kiln_contract.tpu import UnknownTpu, tpu_topology

    try:
        step = StepSpec.from_json(json.loads(Path(args.step).read_text()))
    except (OSError, ValueError, SpecError) as e:
        return fail(f"cannot read the step spec {args.step}: {e}")
    resources = step.runtime.resources
    target = args.target or (resources.type if resources.kind == "tpu" else None)
    if not target:
        return fail(
            f"the step trains on {resources.kind}(...), not a TPU slice: give --target "
            "(v4-128, v5litepod-16, v5e:2x2)"
        )
    try:
        topology = tpu_topology(target)
    except UnknownTpu as e:
        return fail(str(e))
    report = check(step, args.vocab_size, topology, args.variants)
    for line in table_lines_of(report):
        print(line)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m kiln.fit", description=__doc__.splitlines()[0])
    parser.add_argument("step", help="the step spec (step.json) the runner trains from")
    parser.add_argument(
        "--vocab-size", type=int, required=True, help="the tokenizer's vocabulary (the model's)"
    )
    parser.add_argument(
        "--target",
        help="a TPU slice as tpu(...) names it (v4-128, v5litepod-16, v5e-16) or a libtpu "
        "topology (v5e:2x2); default: the step's resources",
    )
    parser.add_argument(
        "--variants",
        type=int,
        default=DEFAULT_VARIANTS,
        help="when it does not fit, compile up to this many other choices, cheapest first, "
        f"until one fits (default {DEFAULT_VARIANTS}; 0: none)",
    )
    parser.add_argument("--json", help="also write the report here, as one JSON object")
    return parser.parse_args(argv)


def fail(message: str) -> int:
    print(f"kiln.fit: error: {message}", file=sys.stderr)
    return 1


def check(step: Any, vocab_size: int, topology: Any, max_variants: int) -> dict[str, Any]:
    """Compiles the declared choice for the slice and, when it does not fit, the remedies in
    order until one fits or `max_variants` were compiled."""
    from kiln.fit.choices import Choice, remedies
    from kiln.fit.compile import compile_step, compiler_hbm, topology_devices
    from kiln.fit.report import report_json
    from kiln_contract.llama import num_parameters
    from kiln_contract.tpu import HBM_GIB

    runtime, cfg = step.runtime, step.config
    devices = topology_devices(topology)
    hbm = compiler_hbm(devices[0])
    source = "the compiler's"
    if hbm is None:
        hbm, source = HBM_GIB[topology.generation] * 2**30, "nominal"
    declared_choice = Choice(
        dict(runtime.mesh), runtime.per_device_parallelism, runtime.gradient_checkpointing
    )
    declared = compile_step(step, vocab_size, devices, declared_choice, hbm)
    variants: list[Any] = []
    if not declared.fits:  # also a choice the slice cannot take (per_device_parallelism)
        candidates = remedies(
            declared_choice, batch_size=cfg.batch_size, seq_len=cfg.seq_len,
            chips=topology.chips, num_heads=cfg.model.num_heads,
            num_kv_heads=cfg.model.num_kv_heads,
        )  # fmt: skip
        compiled = 0
        for choice in candidates:
            if compiled >= max_variants:
                break
            variants.append(compile_step(step, vocab_size, devices, choice, hbm))
            compiled += variants[-1].status != "error"  # refused before any compile: free
            if variants[-1].fits:
                break
    return report_json(
        step=step,
        target={**topology.to_json(), "device_kind": devices[0].device_kind, "hbm_bytes": hbm,
                "hbm_source": source},  # fmt: skip
        model={"parameters": num_parameters(cfg.model, vocab_size), "vocab_size": vocab_size},
        declared=declared,
        variants=variants,
        versions=versions(),
        choice=declared_choice,
        chips=topology.chips,
    )


def versions() -> dict[str, str]:
    found = {}
    for package in ("jax", "libtpu"):
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = "?"
    return found


def table_lines_of(report: dict[str, Any]) -> list[str]:
    from kiln.fit.report import table_lines

    return table_lines(report)


if __name__ == "__main__":
    sys.exit(main())
