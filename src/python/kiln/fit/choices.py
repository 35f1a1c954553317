"""The run-time choices a fit compiles (mesh, per_device_parallelism, remat policy), and the
remedies tried when the declared ones do not fit: the reference's memory checklist (smaller
per-device batches, gradient checkpointing, tensor parallelism), in order of what they cost.

No jax here: the order and the BUILD fields are plain arithmetic, tested on their own.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from kiln_contract.vocabulary import MESH_AXES

# The steps' compute with each remat policy against keeping everything (`none`): `full` runs
# each block's forward again in the backward (6N -> 8N FLOPs a token: +1/3); `save_dots`
# recomputes only the elementwise work between the matmuls; `offload` also moves the matmul
# outputs to the host and back. A rough order, not a measurement.
REMAT_COST = {"none": 1.0, "save_dots": 1.05, "offload": 1.1, "full": 4 / 3}
# Stricter policies to try after each (less memory for activations, more compute).
STRICTER = {"none": ("save_dots", "full"), "save_dots": ("full",), "offload": ("full",),
            "full": ()}  # fmt: skip
# A pass of fewer tokens a chip than this keeps the matrix units less busy: each halving below
# it is counted as 5% slower (a rough order: microbatches do the same FLOPs in smaller matmuls).
FULL_PASS_TOKENS = 8192
SMALL_PASS_COST = 0.05
TENSOR_COST = 0.1  # each doubling of `tensor`: its collectives, per the rough order above
TENSOR_SPLITS = (2, 4, 8)


@dataclass(frozen=True)
class Choice:
    """What the step is compiled with: the mesh as a BUILD file writes it (-1: the rest),
    per_device_parallelism (None: the whole per-device batch in one pass) and the remat policy."""

    mesh: Mapping[str, int] = field(hash=False)
    per_device_parallelism: int | None
    remat: str

    def key(self) -> tuple:
        return (tuple(self.mesh.get(a, 1) for a in MESH_AXES), self.per_device_parallelism,
                self.remat)  # fmt: skip

    def sizes(self, chips: int) -> dict[str, int]:
        """The mesh's axis sizes on `chips` devices (kiln.train.mesh's rule: -1 takes the rest)."""
        fixed = math.prod(self.mesh.get(a, 1) for a in MESH_AXES if self.mesh.get(a, 1) != -1)
        return {a: chips // fixed if self.mesh.get(a, 1) == -1 else self.mesh.get(a, 1)
                for a in MESH_AXES}  # fmt: skip

    def batch_ways(self, chips: int) -> int:
        sizes = self.sizes(chips)
        return sizes["data"] * sizes["fsdp"]

    def rows_per_pass(self, batch_size: int, chips: int) -> int:
        """Sequences a chip holds in one forward and backward."""
        return self.per_device_parallelism or max(1, batch_size // self.batch_ways(chips))

    def microbatches(self, batch_size: int, chips: int) -> int:
        if self.per_device_parallelism is None:
            return 1
        return max(1, batch_size // (self.per_device_parallelism * self.batch_ways(chips)))

    def cost(self, declared: Choice, batch_size: int, seq_len: int, chips: int) -> float:
        """Its step time against the declared choice's, roughly (REMAT_COST, FULL_PASS_TOKENS,
        TENSOR_COST): the order remedies are tried in, not a prediction."""

        def time(choice: Choice) -> float:
            tokens = choice.rows_per_pass(batch_size, chips) * seq_len
            small = max(0.0, math.log2(FULL_PASS_TOKENS / tokens)) if tokens else 0.0
            tensor = math.log2(max(1, choice.sizes(chips)["tensor"]))
            return REMAT_COST[choice.remat] * (1 + SMALL_PASS_COST * small) * (
                1 + TENSOR_COST * tensor
            )

        return time(self) / time(declared)

    def build_fields(self, declared: Choice) -> dict[str, object]:
        """The BUILD fields that turn `declared` into this choice, with their new values."""
        changed: dict[str, object] = {}
        if self.key()[0] != declared.key()[0]:
            changed["mesh"] = {a: s for a, s in self.mesh.items() if s != 1} or {"data": 1}
        if self.per_device_parallelism != declared.per_device_parallelism:
            changed["per_device_parallelism"] = self.per_device_parallelism
        if self.remat != declared.remat:
            changed["gradient_checkpointing"] = self.remat
        return changed

    def to_json(self, batch_size: int, chips: int) -> dict[str, object]:
        return {
            "mesh": dict(self.mesh),
            "mesh_sizes": self.sizes(chips),
            "per_device_parallelism": self.per_device_parallelism,
            "microbatches": self.microbatches(batch_size, chips),
            "rows_per_pass": self.rows_per_pass(batch_size, chips),
            "gradient_checkpointing": self.remat,
        }


def build_text(fields: Mapping[str, object]) -> str:
    """BUILD fields as a BUILD file writes them: per_device_parallelism=4, mesh={"fsdp": -1}."""

    def value(v: object) -> str:
        if isinstance(v, dict):
            return "{" + ", ".join(f'"{k}": {s}' for k, s in v.items()) + "}"
        return f'"{v}"' if isinstance(v, str) else str(v)

    return ", ".join(f"{name}={value(v)}" for name, v in fields.items())


def remedies(
    declared: Choice, *, batch_size: int, seq_len: int, chips: int, num_heads: int,
    num_kv_heads: int,
) -> list[Choice]:  # fmt: skip
    """Other choices that need less memory a chip, cheapest first (Choice.cost): fewer
    sequences a pass (more microbatches), stricter remat policies, the replicated `data` axis
    folded into `fsdp` (parameters and optimizer state sharded over every chip), and `tensor`
    splits of the heads and MLP. Only choices the batch divides into."""
    meshes = [dict(declared.mesh)]
    sizes = declared.sizes(chips)
    if sizes["data"] > 1:  # replicated state: shard it instead
        meshes.append({"data": 1, "fsdp": -1, "tensor": sizes["tensor"]})
    for tensor in TENSOR_SPLITS:
        divides = num_heads % tensor == 0 and num_kv_heads % tensor == 0
        if tensor > sizes["tensor"] and chips % tensor == 0 and divides:
            meshes.append({"data": 1, "fsdp": -1, "tensor": tensor})
    def activations(choice: Choice) -> float:  # a chip's share of a pass, relatively
        return choice.rows_per_pass(batch_size, chips) / choice.sizes(chips)["tensor"]

    candidates: dict[tuple, Choice] = {}
    for mesh in meshes:
        for remat in (declared.remat, *STRICTER.get(declared.remat, ())):
            ways = Choice(mesh, None, remat).batch_ways(chips)
            if ways < 1 or batch_size % ways:
                continue
            rows = batch_size // ways
            for per_device in (rows >> k for k in range(rows.bit_length())):
                if batch_size % (per_device * ways):
                    continue
                choice = Choice(mesh, None if per_device == rows else per_device, remat)
                smaller = activations(choice) < activations(declared)
                no_more = activations(choice) <= activations(declared)
                stricter = remat != declared.remat
                sharded = choice.sizes(chips)["data"] < sizes["data"]  # the state: less a chip
                if smaller or (no_more and (stricter or sharded)):
                    candidates.setdefault(choice.key(), choice)
    return sorted(
        candidates.values(),
        key=lambda c: (c.cost(declared, batch_size, seq_len, chips),
                       len(c.build_fields(declared))),
    )  # fmt: skip
