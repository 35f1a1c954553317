"""A fit check's report: one JSON object (`pants plan --fit`, `--plan-json`, scripts) and the
table people read, made from it. No jax here."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kiln.fit.choices import Choice, build_text
from kiln.fit.compile import GIB, Compiled

FIT_VERSION = 1


def row_json(compiled: Compiled, declared: Choice, batch_size: int, seq_len: int,
             chips: int) -> dict[str, Any]:  # fmt: skip
    return {
        "choice": compiled.choice.to_json(batch_size, chips),
        "build_fields": compiled.choice.build_fields(declared),
        "cost": round(compiled.choice.cost(declared, batch_size, seq_len, chips), 3),
        "status": compiled.status,
        "state_bytes": compiled.state,
        "parameters_bytes": compiled.parameters_bytes,
        "optimizer_bytes": compiled.state - compiled.parameters_bytes,
        "memory": None if compiled.memory is None else compiled.memory.to_json(),
        "required_bytes": compiled.required,
        "hbm_bytes": compiled.limit,
        "message": compiled.message or None,
        "compile_seconds": round(compiled.seconds, 1),
    }


def report_json(
    *, step: Any, target: dict[str, Any], model: dict[str, Any], declared: Compiled,
    variants: Sequence[Compiled], versions: dict[str, str], choice: Choice, chips: int,
) -> dict[str, Any]:  # fmt: skip
    """Everything the check found: the step and the slice, the declared choice's compile, the
    remedies compiled when it does not fit, and the cheapest of them that fits."""
    batch_size, seq_len = step.config.batch_size, step.config.seq_len
    rows = [row_json(v, choice, batch_size, seq_len, chips) for v in variants]
    fitting = [row for row in rows if row["status"] == "fits"]
    return {
        "fit_version": FIT_VERSION,
        "step": {"name": step.name, "version": step.version, "fingerprint": step.fingerprint},
        "target": target,
        "model": model,
        "batch_size": batch_size,
        "seq_len": seq_len,
        "attention": declared.attention,
        "status": declared.status,
        "fits": declared.fits,
        "declared": row_json(declared, choice, batch_size, seq_len, chips),
        "variants": rows,
        "suggestion": min(fitting, key=lambda r: r["cost"]) if fitting else None,
        "versions": versions,
    }


def gib(value: int | None) -> str:
    return "-" if value is None else f"{value / GIB:.2f}"


def describe_choice(choice: dict[str, Any]) -> str:
    sizes = choice["mesh_sizes"]
    mesh = " ".join(f"{axis}={size}" for axis, size in sizes.items() if size != 1) or "data=1"
    passes = choice["microbatches"]
    return (
        f"{mesh}, {choice['rows_per_pass']} seq a pass x {passes}, "
        f"remat {choice['gradient_checkpointing']}"
    )


LABEL_WIDTH = 50
HEADER = (
    f"    {'per chip (GiB)':<{LABEL_WIDTH}} {'state':>6} {'temporaries':>11} {'peak':>6} "
    f"{'HBM':>6} {'fits':>4} {'compile':>8}"
)


def row_line(row: dict[str, Any], label: str) -> str:
    memory = row["memory"]
    if memory is not None:
        temporaries, peak = gib(memory["temporaries"]), gib(memory["peak"])
    elif row["required_bytes"] is not None:  # refused: what it said it needed
        temporaries, peak = f"needs {gib(row['required_bytes'])}", "-"
    else:
        temporaries, peak = "-", "-"
    fits = {"fits": "yes", "does not fit": "no"}.get(row["status"], "err")
    text = f"{label}: {describe_choice(row['choice'])}"
    return (
        f"    {text:<{LABEL_WIDTH}} {gib(row['state_bytes']):>6} {temporaries:>11} {peak:>6} "
        f"{gib(row['hbm_bytes']):>6} {fits:>4} {row['compile_seconds']:>7.0f}s"
    )


def table_lines(report: dict[str, Any], title: str = "") -> list[str]:
    """The report for people: the slice, the declared choice's row, the verdict, and the
    remedies compiled with the cheapest that fits named by its BUILD fields."""
    target, model, declared = report["target"], report["model"], report["declared"]
    step = report["step"]
    versions = ", ".join(f"{name} {version}" for name, version in report["versions"].items())
    lines = [
        f"{title or step['name'] + '@' + step['version']} on {target['slice']}: "
        f"{target['topology']}, {target['chips']} x {target['device_kind']}"
        + (f" ({target['chip_config_name']})" if target.get("chip_config_name") else "")
        + f", {gib(target['hbm_bytes'])} GiB HBM a chip ({target['hbm_source']})",
        f"    {model['parameters']:,} parameters (vocabulary {model['vocab_size']:,}); batch "
        f"{report['batch_size']} x {report['seq_len']}; {report['attention']} attention; "
        f"compiled with {versions}",
        HEADER,
        row_line(declared, "declared"),
    ]
    lines.append(f"    {verdict(report)}")
    if report["variants"]:
        lines.append("    what else was compiled, cheapest first (~cost: the step time, roughly):")
        for row in report["variants"]:
            lines.append(row_line(row, f"~{row['cost']:.2f}"))
            if row["status"] == "error" and row["message"]:
                lines.append(f"        {row['message'][:150]}")
    suggestion = report["suggestion"]
    if suggestion is not None:
        lines.append(
            f"    fits with: {build_text(suggestion['build_fields'])} (peak "
            f"{gib(suggestion['memory']['peak'])} GiB a chip; ~{suggestion['cost']:.2f}x the "
            "step time, roughly)"
        )
    elif not report["fits"] and report["variants"]:
        lines.append("    none of these fits: a larger slice, or a smaller batch or model")
    return lines


def verdict(report: dict[str, Any]) -> str:
    declared = report["declared"]
    hbm = declared["hbm_bytes"]
    if declared["status"] == "fits":
        peak = declared["memory"]["peak"]
        return f"fits: peak {gib(peak)} of {gib(hbm)} GiB a chip ({100 * peak / hbm:.0f}%)"
    if declared["status"] == "error":
        return f"did not compile: {declared['message']}"
    if declared["memory"] is not None:
        return (
            f"does not fit: peak {gib(declared['memory']['peak'])} GiB a chip, the chip has "
            f"{gib(hbm)}"
        )
    if declared["required_bytes"] is not None:
        return (
            f"does not fit: the compiler needs {gib(declared['required_bytes'])} GiB of "
            f"temporaries beside {gib(declared['state_bytes'])} GiB of parameters and optimizer "
            f"state, the chip has {gib(hbm)} (\"{declared['message']}\")"
        )
    return f"does not fit, the compiler says: {declared['message']}"
