"""The trainer's step compiled for a TPU slice that is not here: libtpu's mock devices
(jax.experimental.topologies) on a CPU machine, the executable's memory per chip.

jax must run on its CPU backend in this process (JAX_PLATFORMS=cpu, kiln.fit.__main__): the
mock devices exist only for the compiler, nothing runs on them, and a real TPU is never touched.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from collections.abc import Sequence
from typing import Any

from kiln.fit.choices import Choice
from kiln_contract.step import StepSpec
from kiln_contract.tpu import TpuTopology

GIB = 2**30
# The compiler's refusal of an executable larger than the chip: jax 0.11's libtpu says
# "... the total memory required for HLO temporaries (16.20G) exceeds available HBM (15.75G)";
# older ones "Ran out of memory in memory space hbm. Used 20.51G of 15.48G hbm."
_OUT_OF_MEMORY = re.compile(r"Ran out of memory (?:on HBM|in memory space hbm)", re.I)
_REQUIRED = re.compile(r"required for ([\w ]+?) \(([\d.]+)([KMGT]?)\) exceeds available HBM "
                       r"\(([\d.]+)([KMGT]?)\)")  # fmt: skip
_USED = re.compile(r"Used ([\d.]+)([KMGT]?) of ([\d.]+)([KMGT]?) hbm", re.I)
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


@dataclasses.dataclass(frozen=True)
class Memory:
    """An executable's memory a chip (bytes), as the compiler's memory_analysis() counts it."""

    arguments: int  # the state and the batch
    outputs: int
    alias: int  # outputs written into donated arguments (the state)
    temporaries: int  # activations, gradients, workspace
    host_temporaries: int  # host memory (remat offload's saved activations)

    @property
    def peak(self) -> int:
        """What the executable holds at once on the chip."""
        return self.arguments + self.outputs - self.alias + self.temporaries

    def to_json(self) -> dict[str, int]:
        return {**dataclasses.asdict(self), "peak": self.peak}


@dataclasses.dataclass(frozen=True)
class Compiled:
    """One compile of the step with one Choice: fits, out of memory, or an error."""

    choice: Choice
    status: str  # "fits", "does not fit" or "error"
    state: int  # parameters and optimizer state a chip, bytes (from their shardings)
    parameters_bytes: int
    memory: Memory | None  # None: the compiler refused it, or it did not compile
    required: int | None  # what the compiler said it needed, when it refused
    limit: int | None  # ... and what it had
    message: str  # the compiler's refusal, or the error, in one line
    seconds: float
    attention: str

    @property
    def fits(self) -> bool:
        return self.status == "fits"


def topology_devices(topology: TpuTopology) -> list[Any]:
    """The mock devices of the slice, one per chip (megacore where the chip has two cores)."""
    from jax.experimental import topologies

    options: dict[str, Any] = {}
    if topology.chip_config_name:
        options["chip_config_name"] = topology.chip_config_name
    if topology.chips_per_host_bounds:
        options["chips_per_host_bounds"] = topology.chips_per_host_bounds
    description = topologies.get_topology_desc(
        topology_name=topology.name, platform="tpu", **options
    )
    devices = list(description.devices)
    if len(devices) != topology.chips:
        raise RuntimeError(
            f"libtpu made {len(devices)} devices for {topology.name}, expected {topology.chips}"
        )
    return devices


def compiler_hbm(device: Any) -> int | None:
    """The chip's HBM as the compiler counts it (what an executable must fit in), read from its
    refusal of a product far too large for any chip: about a second. None if it says nothing."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    side = 1 << 19  # a 2^38-element bf16 product: 512 GiB
    operand = jax.ShapeDtypeStruct((side, side), jnp.bfloat16, sharding=SingleDeviceSharding(device))
    try:
        jax.jit(lambda a: a @ a.T).lower(operand).compile()
    except Exception as error:  # noqa: BLE001 - the refusal is the answer
        return refusal_numbers(str(error))[1]
    return None


def refusal_numbers(message: str) -> tuple[int | None, int | None]:
    """(needed, available) bytes from the compiler's out-of-memory message; None where absent."""
    match = _REQUIRED.search(message)
    if match:
        return _bytes(match.group(2), match.group(3)), _bytes(match.group(4), match.group(5))
    match = _USED.search(message)
    if match:
        return _bytes(match.group(1), match.group(2)), _bytes(match.group(3), match.group(4))
    return None, None


def is_out_of_memory(message: str) -> bool:
    return bool(_OUT_OF_MEMORY.search(message))


def _bytes(number: str, unit: str) -> int:
    return int(float(number) * _UNITS[unit.upper()])


def per_chip_bytes(tree: Any) -> int:
    """Bytes a chip holds of a tree of ShapeDtypeStructs with shardings (the largest shard:
    every chip holds one of that shape)."""
    import jax

    total = 0
    for leaf in jax.tree.leaves(tree):
        shape = leaf.sharding.shard_shape(leaf.shape)
        total += math.prod(shape) * leaf.dtype.itemsize
    return total


def compile_step(
    step: StepSpec, vocab_size: int, devices: Sequence[Any], choice: Choice, hbm: int
) -> Compiled:
    """The step, as training jits it, compiled for `devices` with `choice`; fits when the
    compiler accepts it and its peak is within `hbm` bytes."""
    import jax
    import jax.numpy as jnp

    from kiln.model.attention import resolve_attention_impl
    from kiln.model.config import LlamaConfig
    from kiln.train.mesh import batch_parallelism, batch_sharding, make_mesh, microbatch_count
    from kiln.train.step import BATCH_FIELDS, ModelOptions, abstract_train_state, jit_train_step

    cfg = step.config
    platform = devices[0].platform
    attention = resolve_attention_impl(step.runtime.attention, platform=platform)
    start = time.perf_counter()
    state_bytes = parameters_bytes = 0

    def result(status: str, message: str = "", **fields: Any) -> Compiled:
        return Compiled(
            choice=choice, status=status, state=state_bytes, parameters_bytes=parameters_bytes,
            memory=fields.get("memory"), required=fields.get("required"),
            limit=fields.get("limit"), message=message,
            seconds=time.perf_counter() - start, attention=attention,
        )  # fmt: skip

    try:
        mesh = make_mesh(dict(choice.mesh), devices=devices)
        microbatches = microbatch_count(
            cfg.batch_size, choice.per_device_parallelism, batch_parallelism(mesh)
        )
        model = LlamaConfig.for_vocabulary(cfg.model, vocab_size)
        options = ModelOptions(
            compute_dtype=cfg.compute_dtype, param_dtype=cfg.param_dtype, attention=attention,
            remat=choice.remat,
        )  # fmt: skip
        state = abstract_train_state(
            model, cfg.optimizer, cfg.num_train_steps, mesh=mesh, options=options
        )
        state_bytes = per_chip_bytes((state.params, state.opt_state, state.step))
        parameters_bytes = per_chip_bytes(state.params)
        rows = batch_sharding(mesh)
        batch = {
            name: jax.ShapeDtypeStruct((cfg.batch_size, cfg.seq_len), jnp.dtype(dtype), sharding=rows)
            for name, dtype in BATCH_FIELDS.items()
        }
        train_step = jit_train_step(
            cfg.optimizer, cfg.num_train_steps, z_loss_weight=cfg.z_loss_weight, mesh=mesh,
            microbatches=microbatches,
        )  # fmt: skip
        with jax.set_mesh(mesh):
            lowered = train_step.lower(state, batch)
    except Exception as error:  # noqa: BLE001 - a choice the slice or the batch cannot take
        return result("error", _one_line(error))
    try:
        stats = lowered.compile().memory_analysis()
    except Exception as error:  # noqa: BLE001 - the compiler's refusal, or its failure
        text = _one_line(error)
        if not is_out_of_memory(text):
            return result("error", text)
        required, limit = refusal_numbers(text)
        return result("does not fit", text, required=required, limit=limit or hbm)
    memory = Memory(
        arguments=stats.argument_size_in_bytes,
        outputs=stats.output_size_in_bytes,
        alias=stats.alias_size_in_bytes,
        temporaries=stats.temp_size_in_bytes,
        host_temporaries=stats.host_temp_size_in_bytes,
    )
    status = "fits" if memory.peak <= hbm else "does not fit"
    return result(status, memory=memory, limit=hbm)


def _one_line(error: BaseException) -> str:
    """The error as one line: the compiler's own words, or the exception's type and message."""
    text = " ".join(str(error).split())
    for prefix in ("RESOURCE_EXHAUSTED: ", "XLA:TPU compile permanent error. "):
        text = text.replace(prefix, "")
    if "RuntimeError" not in type(error).__name__:  # jax's errors are the compiler's words
        text = f"{type(error).__name__}: {text}"
    return text[:600]
