"""Where a train step's time goes: capture a jax.profiler trace, attribute every device op to a
category through its HLO metadata, and print ms per step and % of step.

    PYTHONPATH=src/python python3 benchmarks/step_profile.py TRACE_DIR --steps 3 [--wall-ms MS]

The trace (an XSpace, `*.xplane.pb` under TRACE_DIR) holds the ops that ran, each with `hlo_op`,
`hlo_module` and `program_id` stats: on GPU on the device plane's stream lines (CUPTI kernels),
on CPU on the host plane's XLA threads (one event per thunk); on TPU each op is an event of
the core's "XLA Ops" line named by its HLO text, inside its executable's event on "XLA
Modules". Its metadata plane holds the HLO
proto of every executable, whose instructions carry `op_name`, the jax name stack with the
named scopes the step puts on its parts (kiln.model.attention.ATTENTION_SCOPE,
kiln.train.step.LOSS_SCOPE and OPTIMIZER_SCOPE). Ops inside the attention scope split by the
pass they belong to: jax names the backward pass `transpose(...)` and, under remat, the
forward it recomputes there `rematted_computation`.

Ops that overlap in time on one device (CPU threads, GPU streams) share that time equally, so
the categories add up to the time the device was busy; "host / idle" is the rest of the step's
wall time. With several devices, each is split on its own and the splits are averaged.

On GPU, XLA records kernels into command buffers (CUDA graphs) by default, and a trace then names
their kernels only by the command buffer: name_every_kernel() turns command buffers off for the
process (it must run before jax starts its backend). An op missing from the trace's HLO protos
is categorised by the op name its GPU annotation carries, if any (else as "elementwise and
other"), and the table says how much time such ops took.
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import os
import time
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import jax

from kiln.model.attention import ATTENTION_SCOPE
from kiln.train.step import LOSS_SCOPE, OPTIMIZER_SCOPE

MATMULS = "matmuls"
ATTENTION_FORWARD = "attention forward"
ATTENTION_RECOMPUTED = "attention recomputed forward"
ATTENTION_BACKWARD = "attention backward"
LM_HEAD_LOSS = "lm head + loss"
OPTIMIZER = "optimizer"
COLLECTIVES = "collectives"
ELEMENTWISE = "elementwise and other"
HOST_IDLE = "host / idle"
CATEGORIES = (
    MATMULS, ATTENTION_FORWARD, ATTENTION_RECOMPUTED, ATTENTION_BACKWARD, LM_HEAD_LOSS, OPTIMIZER,
    COLLECTIVES, ELEMENTWISE, HOST_IDLE,
)  # fmt: skip

# jax's name-stack markers: the backward pass, and the forward that remat recomputes in it.
BACKWARD_MARKER = "transpose("
RECOMPUTE_MARKER = "rematted_computation"
MATMUL_OPCODES = {"dot", "convolution", "ragged-dot"}
COLLECTIVE_OPCODES = {
    "all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute",
    "all-gather-start", "all-gather-done", "all-reduce-start", "all-reduce-done",
    "collective-permute-start", "collective-permute-done", "send", "recv", "send-done",
    "recv-done",
}  # fmt: skip
# Ops that only run others (their own events span their children's): time counts for them only
# where none of their children runs.
CONTAINER_OPCODES = {"while", "conditional", "call", "async-start", "async-done"}


@dataclasses.dataclass(frozen=True)
class HloOp:
    """What the categoriser needs of one HLO instruction."""

    opcode: str
    op_name: str  # its metadata's op_name, or that of the computation it calls (a fusion's root)
    custom_call_target: str = ""
    contains_matmul: bool = False  # a fusion with a dot inside (XLA's gemm fusions)


@dataclasses.dataclass(frozen=True)
class OpEvent:
    """One run of one HLO op: [start_ns, end_ns) on some thread or stream."""

    start_ns: float
    end_ns: float
    category: str
    container: bool = False
    hlo_op: str = ""
    op_name: str = ""
    named: bool = True  # False: not in the trace's HLO protos
    device: str = ""  # the trace plane it ran on: /device:GPU:N, or /host:CPU


def categorise(op: HloOp) -> str:
    """The category of one op: its named scope first, then what kind of op it is."""
    if ATTENTION_SCOPE in op.op_name:
        if RECOMPUTE_MARKER in op.op_name:
            return ATTENTION_RECOMPUTED
        return ATTENTION_BACKWARD if BACKWARD_MARKER in op.op_name else ATTENTION_FORWARD
    if LOSS_SCOPE in op.op_name:
        return LM_HEAD_LOSS
    if OPTIMIZER_SCOPE in op.op_name:
        return OPTIMIZER
    if op.opcode in COLLECTIVE_OPCODES:
        return COLLECTIVES
    target = op.custom_call_target.lower()
    if op.opcode in MATMUL_OPCODES or op.contains_matmul or "gemm" in target or "matmul" in target:
        return MATMULS
    return ELEMENTWISE


def split_by_category(events: Iterable[OpEvent]) -> dict[str, float]:
    """ns of device time per category. Where ops overlap they share the time equally; a container
    (a while loop's own event) counts only where no other op runs."""
    boundaries: list[tuple[float, int, OpEvent]] = []
    for event in events:
        if event.end_ns > event.start_ns:
            boundaries += [(event.start_ns, 1, event), (event.end_ns, -1, event)]
    boundaries.sort(key=lambda boundary: (boundary[0], boundary[1]))
    totals: dict[str, float] = defaultdict(float)
    running: dict[int, OpEvent] = {}
    last_ns = 0.0
    for now_ns, kind, event in boundaries:
        if running and now_ns > last_ns:
            _share(now_ns - last_ns, running.values(), totals)
        if kind == 1:
            running[id(event)] = event
        else:
            running.pop(id(event), None)
        last_ns = now_ns
    return dict(totals)


def _share(span_ns: float, running: Iterable[OpEvent], totals: dict[str, float]) -> None:
    running = list(running)
    leaves = [event for event in running if not event.container] or running[-1:]
    for event in leaves:
        totals[event.category] += span_ns / len(leaves)


def step_split(
    events: Iterable[OpEvent], steps: int, wall_ns: float | None = None
) -> dict[str, float]:
    """ms per step for every category, "host / idle" included: the steps' wall time (default:
    from the first op's start to the last op's end) less the time some op ran."""
    events = list(events)
    busy = _mean_over_devices(events)
    if wall_ns is None:
        wall_ns = max(e.end_ns for e in events) - min(e.start_ns for e in events) if events else 0
    split = {category: busy.get(category, 0.0) / steps / 1e6 for category in CATEGORIES}
    split[HOST_IDLE] = max(0.0, wall_ns - sum(busy.values())) / steps / 1e6
    return split


def _mean_over_devices(events: list[OpEvent]) -> dict[str, float]:
    """split_by_category of each device's own events (a GPU's, or the host's on CPU), averaged."""
    by_device: dict[str, list[OpEvent]] = defaultdict(list)
    for event in events:
        by_device[event.device].append(event)
    totals: dict[str, float] = defaultdict(float)
    for device_events in by_device.values():
        for category, ns in split_by_category(device_events).items():
            totals[category] += ns / len(by_device)
    return dict(totals)


def unnamed_note(events: Iterable[OpEvent], steps: int) -> str | None:
    """A line on the time in ops the trace's HLO does not name, if there was any."""
    unnamed = [event for event in events if not event.named]
    if not unnamed:
        return None
    ms = sum(event.end_ns - event.start_ns for event in unnamed) / steps / 1e6
    examples = ", ".join(sorted({event.hlo_op for event in unnamed})[:3])
    return (
        f"{ms:.2f} ms/step in ops missing from the trace's HLO ({examples}): categorised by the "
        "names the trace gives them, never as matmuls"
    )


def name_every_kernel() -> None:
    """Turns XLA's GPU command buffers off (XLA_FLAGS), so that the trace names every kernel's HLO
    op; without effect once jax has started its backend, and on CPU."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_gpu_enable_command_buffer" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_gpu_enable_command_buffer=".strip()


def format_table(split: dict[str, float]) -> str:
    step_ms = sum(split.values())
    lines = [f"{'category':<30} {'ms/step':>10} {'% of step':>10}"]
    lines.append("-" * len(lines[0]))
    for category in CATEGORIES:
        share = 100 * split[category] / step_ms if step_ms else 0.0
        lines.append(f"{category:<30} {split[category]:>10.2f} {share:>9.1f}%")
    lines.append(f"{'step':<30} {step_ms:>10.2f} {100.0 if step_ms else 0.0:>9.1f}%")
    return "\n".join(lines)


# Capturing.


def capture(run: Callable[[], None], log_dir: str | Path) -> tuple[Path, float]:
    """Runs `run` (which must wait for its results) under jax.profiler; returns the trace's
    .xplane.pb and the wall ns `run` took. Python functions are not traced: the trace holds
    XLA's ops and the host's runtime events."""
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    with jax.profiler.trace(str(log_dir), profiler_options=options):
        start = time.perf_counter_ns()
        run()
        wall_ns = time.perf_counter_ns() - start
    return latest_xplane(log_dir), float(wall_ns)


def latest_xplane(log_dir: str | Path) -> Path:
    found = sorted(Path(log_dir).glob("plugins/profile/*/*.xplane.pb"))
    if not found:
        raise FileNotFoundError(f"{log_dir}: no plugins/profile/*/*.xplane.pb (a jax.profiler trace)")
    return found[-1]


# Reading a trace: the events with their op's category.


def read_op_events(xplane_path: str | Path) -> list[OpEvent]:
    """Every XLA op event in the trace, categorised. Device planes (/device:GPU:N) when the trace
    has ops on them; otherwise the host's (CPU executables)."""
    profile = jax.profiler.ProfileData.from_file(str(xplane_path))
    with warnings.catch_warnings():  # jaxlib 0.11's stats iterator warns on Python 3.12
        warnings.filterwarnings("ignore", "builtin type event_stats", DeprecationWarning)
        device_planes = [p for p in profile.planes if p.name.startswith("/device:")]
        raw = [event for plane in device_planes for event in _plane_op_events(plane)]
        on_device = bool(raw)
        if not on_device:
            host_planes = [p for p in profile.planes if p.name.startswith("/host:")]
            raw = [event for plane in host_planes for event in _plane_op_events(plane)]
    if not raw:
        raise ValueError(f"{xplane_path}: no XLA op events (none with an hlo_op stat)")
    programs = {stats.get("program_id") for *_, stats in raw}
    wanted = None if None in programs else programs  # without ids, modules are found by name
    modules = hlo_modules(memoryview(Path(xplane_path).read_bytes()), wanted=wanted)
    events = []
    for device, start_ns, duration_ns, stats in raw:
        program, module = stats.get("program_id", -1), stats.get("hlo_module", "")
        ops = modules.get(program) or modules.get(module, {})
        op = ops.get(stats["hlo_op"])
        named = op is not None
        if op is None:
            op = HloOp(opcode="", op_name=_annotated_op_name(stats))
        events.append(
            OpEvent(
                start_ns=start_ns,
                end_ns=start_ns + duration_ns,
                category=categorise(op),
                container=op.opcode in CONTAINER_OPCODES,
                hlo_op=stats["hlo_op"],
                op_name=op.op_name,
                named=named,
                device=device,
            )
        )
    if on_device:
        return events
    return events + cpu_async_tails(events, list(_cpu_executable_runs(profile)))


def cpu_async_tails(events: list[OpEvent], runs: list[tuple[float, float]]) -> list[OpEvent]:
    """XLA:CPU hands dots, YNNPACK fusions and parallel loops to worker threads that the trace
    does not show: an op's event ends when its work is handed over, and the executor waits for it.
    Within an executable's run (`runs`: [start, end) of each), the time in which no op runs is the
    op's that ended last before it: an event of its own per run it overlaps."""
    tails: list[OpEvent] = []
    busy_until, last = 0.0, None
    for event in sorted(events, key=lambda e: e.start_ns):
        if last is not None and event.start_ns > busy_until:
            for run_start, run_end in runs:
                start, end = max(busy_until, run_start), min(event.start_ns, run_end)
                if end > start:
                    tails.append(dataclasses.replace(last, start_ns=start, end_ns=end))
        if last is None or event.end_ns >= busy_until:
            busy_until, last = event.end_ns, event
    return tails


# XLA:CPU's event for the span in which the caller waits for an executable's thunks.
CPU_RUN_EVENT = "ThunkExecutor::Execute (wait for completion)"


def _cpu_executable_runs(profile) -> Iterator[tuple[float, float]]:
    for plane in profile.planes:
        for line in plane.lines:
            for event in line.events:
                if event.name == CPU_RUN_EVENT:
                    yield float(event.start_ns), float(event.start_ns + event.duration_ns)


def _annotated_op_name(stats: dict) -> str:
    """The op_name XLA:GPU's kernel annotation carries: the module's common prefix, and the rest
    of what the op's (and its fusion's) op_names share."""
    return "/".join(str(stats[key]) for key in ("prefix", "name") if stats.get(key))


def _plane_op_events(plane) -> Iterator[tuple[str, float, float, dict]]:
    if plane.name.startswith("/device:TPU"):
        yield from _tpu_op_events(plane)
        return
    for line in plane.lines:
        if line.name == "python3":  # the Python thread's own events, never an op
            continue
        for event in line.events:
            stats = {name: value for name, value in event.stats}
            if "hlo_op" in stats:
                yield plane.name, float(event.start_ns), float(event.duration_ns), stats


# A TPU core's plane: its "XLA Ops" line holds the ops the core runs one after another, each
# event named by its HLO text ("%fusion.3 = (...) fusion(...)"), and its "XLA Modules" line the
# executables' runs around them. "Async XLA Ops" are copies that overlap the ops (not busy time).
TPU_OPS_LINE, TPU_MODULES_LINE = "XLA Ops", "XLA Modules"


def _tpu_op_events(plane) -> Iterator[tuple[str, float, float, dict]]:
    lines = {line.name: line for line in plane.lines}
    if TPU_OPS_LINE not in lines:
        return
    runs = sorted(
        (float(event.start_ns), float(event.start_ns + event.duration_ns), event.name)
        for event in (lines[TPU_MODULES_LINE].events if TPU_MODULES_LINE in lines else ())
    )
    starts = [start for start, _, _ in runs]
    for event in lines[TPU_OPS_LINE].events:
        start = float(event.start_ns)
        stats = {"hlo_op": event.name.split(" = ", 1)[0].lstrip("%")}
        run = bisect.bisect_right(starts, start) - 1
        if run >= 0 and start < runs[run][1]:
            stats["hlo_module"] = runs[run][2].split("(")[0]
        yield plane.name, start, float(event.duration_ns), stats


# The HLO protos in the trace's metadata plane, read with a minimal protobuf wire decoder
# (field numbers from tsl's xplane.proto and xla's hlo.proto; no generated modules ship with
# jaxlib).
XSPACE_PLANES = 1
XPLANE_EVENT_METADATA, XPLANE_STAT_METADATA = 4, 5
MAP_VALUE = 2
XEVENT_METADATA_NAME, XEVENT_METADATA_STATS = 2, 5
XSTAT_METADATA_ID, XSTAT_METADATA_NAME = 1, 2
XSTAT_METADATA, XSTAT_INT64, XSTAT_UINT64, XSTAT_BYTES = 1, 4, 3, 6
HLO_PROTO_MODULE = 1
MODULE_COMPUTATIONS = 3
COMPUTATION_INSTRUCTIONS, COMPUTATION_ID, COMPUTATION_ROOT_ID = 2, 5, 6
INSTRUCTION_NAME, INSTRUCTION_OPCODE, INSTRUCTION_METADATA = 1, 2, 7
INSTRUCTION_CUSTOM_CALL_TARGET, INSTRUCTION_ID, INSTRUCTION_CALLED_COMPUTATIONS = 28, 35, 38
OP_METADATA_OP_NAME = 2


def hlo_modules(
    xspace: memoryview, wanted: set | None = None
) -> dict[int | str, dict[str, HloOp]]:
    """{program id and module name: {instruction name: HloOp}} from the metadata plane's
    "Hlo Proto" stats; only the program ids in `wanted` when given."""
    modules: dict[int | str, dict[str, HloOp]] = {}
    for field, plane in _fields(xspace):
        if field != XSPACE_PLANES:
            continue
        stat_names = {}
        for key, value in _fields(plane):
            if key == XPLANE_STAT_METADATA:
                metadata = _message(_message(value)[MAP_VALUE])
                stat_names[metadata.get(XSTAT_METADATA_ID, 0)] = _text(
                    metadata.get(XSTAT_METADATA_NAME, b"")
                )
        for key, value in _fields(plane):
            if key != XPLANE_EVENT_METADATA:
                continue
            name, program_id, proto = _hlo_proto_stats(_message(value)[MAP_VALUE], stat_names)
            if proto is None or (wanted is not None and program_id not in wanted):
                continue
            ops = _module_ops(_message(proto)[HLO_PROTO_MODULE])
            modules[name.split("(")[0]] = ops
            if program_id is not None:
                modules[program_id] = ops
    return modules


def _hlo_proto_stats(event_metadata, stat_names):
    name, program_id, proto = "", None, None
    for key, value in _fields(event_metadata):
        if key == XEVENT_METADATA_NAME:
            name = _text(value)
        elif key == XEVENT_METADATA_STATS:
            stat = _message(value)
            stat_name = stat_names.get(stat.get(XSTAT_METADATA))
            if stat_name == "Hlo Proto":
                proto = stat.get(XSTAT_BYTES)
            elif stat_name == "program_id":
                program_id = stat.get(XSTAT_INT64, stat.get(XSTAT_UINT64))
    return name, program_id, proto


def _module_ops(module) -> dict[str, HloOp]:
    computations = {}  # id -> (its root instruction's id, [_instruction(...) of each])
    for key, value in _fields(module):
        if key != MODULE_COMPUTATIONS:
            continue
        instructions, root_id, computation_id = [], None, None
        for field, raw in _fields(value):
            if field == COMPUTATION_INSTRUCTIONS:
                instructions.append(_instruction(raw))
            elif field == COMPUTATION_ROOT_ID:
                root_id = raw
            elif field == COMPUTATION_ID:
                computation_id = raw
        computations[computation_id] = (root_id, instructions)
    summaries = {cid: _summary(root_id, insts) for cid, (root_id, insts) in computations.items()}
    ops = {}
    for _, instructions in computations.values():
        for _, name, opcode, op_name, target, calls in instructions:
            called = [summaries[c] for c in calls if c in summaries]
            if not op_name:  # a fusion's own metadata may be empty: its root's names it
                op_name = next((root_name for root_name, _ in called if root_name), "")
            has_dot = opcode == "fusion" and any(dot for _, dot in called)
            ops[name] = HloOp(opcode, op_name, target, has_dot)
    return ops


def _summary(root_id, instructions) -> tuple[str, bool]:
    """(the op_name of the computation's root, or its first non-empty one; whether it has a dot)."""
    names = [op_name for _, _, _, op_name, _, _ in instructions if op_name]
    root = next((i[3] for i in instructions if i[0] == root_id and i[3]), None)
    has_dot = any(i[2] in MATMUL_OPCODES for i in instructions)
    return root or (names[0] if names else ""), has_dot


def _instruction(raw) -> tuple:
    name = opcode = op_name = target = ""
    instruction_id, calls = None, []
    for field, value in _fields(raw):
        if field == INSTRUCTION_NAME:
            name = _text(value)
        elif field == INSTRUCTION_OPCODE:
            opcode = _text(value)
        elif field == INSTRUCTION_METADATA:
            op_name = _text(_message(value).get(OP_METADATA_OP_NAME, b""))
        elif field == INSTRUCTION_CUSTOM_CALL_TARGET:
            target = _text(value)
        elif field == INSTRUCTION_ID:
            instruction_id = value
        elif field == INSTRUCTION_CALLED_COMPUTATIONS:
            calls += _packed_varints(value) if isinstance(value, memoryview) else [value]
    return instruction_id, name, opcode, op_name, target, calls


def _fields(buffer) -> Iterator[tuple[int, int | memoryview]]:
    """(field number, value) of a protobuf message: varints as ints, length-delimited fields as
    memoryviews (strings, bytes, sub-messages, packed repeated fields)."""
    index, end = 0, len(buffer)
    while index < end:
        key, index = _varint(buffer, index)
        field, wire_type = key >> 3, key & 7
        if wire_type == 0:
            value, index = _varint(buffer, index)
        elif wire_type == 2:
            length, index = _varint(buffer, index)
            value, index = buffer[index : index + length], index + length
        elif wire_type in (1, 5):  # fixed 64 / 32 bits: not a field read here
            width = 8 if wire_type == 1 else 4
            value, index = buffer[index : index + width], index + width
        else:
            raise ValueError(f"protobuf wire type {wire_type} at byte {index}: not an XSpace")
        yield field, value


def _message(buffer) -> dict[int, int | memoryview]:
    """The last value of each field (for messages whose fields read here are not repeated)."""
    return dict(_fields(buffer))


def _varint(buffer, index: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        byte = buffer[index]
        index += 1
        result |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return result, index


def _packed_varints(buffer) -> list[int]:
    values, index = [], 0
    while index < len(buffer):
        value, index = _varint(buffer, index)
        values.append(value)
    return values


def _text(value) -> str:
    return bytes(value).decode("utf-8", errors="replace")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace_dir", help="a jax.profiler.trace log dir, or an .xplane.pb")
    parser.add_argument("--steps", type=int, default=1, help="steps the trace holds")
    parser.add_argument("--wall-ms", type=float, help="their wall time (default: the ops' span)")
    args = parser.parse_args(argv)
    path = Path(args.trace_dir)
    xplane = path if path.is_file() else latest_xplane(path)
    wall_ns = None if args.wall_ms is None else args.wall_ms * 1e6
    events = read_op_events(xplane)
    print(format_table(step_split(events, args.steps, wall_ns)))
    note = unnamed_note(events, args.steps)
    if note:
        print(note)


if __name__ == "__main__":
    main()
