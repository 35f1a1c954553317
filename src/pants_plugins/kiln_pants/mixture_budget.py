"""What a checkpoint's training mixture reads from each of its caches, against what each holds.

A run of `num_train_steps` steps of `batch_size` sequences of `seq_len` tokens reads from each
component its weight share of those sequences (the mixture's blocks hold that share of each
dataset: kiln.data.mixture). A cache holds what its `cache.json` says once built, or at least
its `max_tokens` before. A cache bounded by `max_tokens` that is too small for its share is
refused before anything is built: the run would repeat its data, which the bound is there to
avoid. An unbounded cache smaller than its share is the whole source: the run repeats it (a new
shuffle per epoch, as in Marin), and the plan says how many times.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Optional

from pants.base.build_root import BuildRoot
from pants.engine.addresses import Address
from pants.engine.rules import _uncacheable_rule, collect_rules

from kiln_pants.artifact_graph import Artifact, ArtifactGraph, artifact_and_graph
from kiln_pants.artifact_store import artifact_path, stored_state
from kiln_pants.subsystem import KilnSubsystem

CACHE_INFO_FILE = "cache.json"  # kiln.data.cache.CACHE_FILE: documents, tokens, ...


@dataclass(frozen=True)
class ComponentBudget:
    cache: Artifact
    weight: float
    share: float  # weight / sum of weights
    sequence_len: int
    sequences: int  # of seq_len tokens, that the run reads from this cache
    holds: Optional[int]  # tokens: built, imported, or at least max_tokens; None: not known
    built: bool
    imported: bool = False  # `holds` is an imported cache's ledger count
    stage_sequences: tuple[int, ...] = ()  # with stages: the sequences each stage reads
    stage_starts: tuple[int, ...] = ()  # with stages: the step each starts at

    @property
    def reads(self) -> int:
        return self.sequences * self.sequence_len

    @property
    def bounded(self) -> bool:
        return self.cache.identity.get("max_tokens") is not None

    @property
    def epochs(self) -> Optional[float]:
        """How many times the run reads the cache's windows (the last partial one is dropped)."""
        if self.holds is None:
            return None
        return self.sequences / max(self.holds // self.sequence_len, 1)

    @property
    def too_small(self) -> bool:
        return self.bounded and self.epochs is not None and self.epochs > 1

    def describe(self) -> str:
        if self.holds is None:
            holds = "holds the whole source (unknown until built)"
        elif self.built:
            holds = f"holds {count(self.holds)} (built)"
        elif self.imported:
            holds = f"holds {count(self.holds)} (its shard_ledger.json)"
        else:
            holds = f"will hold >= {count(self.holds)} (max_tokens)"
        line = (
            f"{self.cache.ref:<48} weight {self.weight:g} ({self.share:.1%}): reads "
            f"{count(self.reads)} tokens{self._by_stage()}, {holds}"
        )
        if self.too_small:
            return f"{line}\n    !! too small for its share: raise `max_tokens` on {self.cache.address}"
        if self.epochs is not None and self.epochs > 1:
            return f"{line}; read {self.epochs:.1f} times"
        return line


    def _by_stage(self) -> str:
        if not self.stage_sequences:
            return ""
        parts = [f"from step {start}: {count(n * self.sequence_len)}"
                 for start, n in zip(self.stage_starts, self.stage_sequences)]  # fmt: skip
        return f" ({'; '.join(parts)})"


@dataclass(frozen=True)
class MixtureBudget:
    checkpoint: Artifact
    components: tuple[ComponentBudget, ...]

    @property
    def tokens(self) -> int:
        identity = self.checkpoint.identity
        return identity["batch_size"] * identity["seq_len"] * identity["num_train_steps"]

    def header(self) -> str:
        identity = self.checkpoint.identity
        return (
            f"Training data of {self.checkpoint.ref}: {identity['batch_size']} x "
            f"{identity['seq_len']} tokens x {identity['num_train_steps']} steps = "
            f"{count(self.tokens)} tokens"
        )

    def refusal(self) -> Optional[str]:
        """The error for caches too small for their share, or None."""
        small = [c for c in self.components if c.too_small]
        if not small:
            return None
        lines = "\n".join(f"  {c.describe()}" for c in small)
        return (
            f"{self.checkpoint.address} reads more tokens from these caches than their "
            f"`max_tokens` gives them, so it would repeat their data; nothing was built:\n{lines}"
        )


def count(tokens: float) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if tokens >= size:
            return f"{tokens / size:.2f}{unit}"
    return f"{tokens:.0f}"


def mixture_budget(
    checkpoint: Artifact,
    graph: ArtifactGraph,
    held: Mapping[str, int],
    imported: Optional[Mapping[str, int]] = None,
) -> MixtureBudget:
    """The budget of `checkpoint`'s datasets; `held` maps a built cache's ref to its tokens,
    `imported` an unbuilt import's ref to its ledger's. A mixture with stages reads each stage's
    steps by that stage's weights."""
    imported = imported or {}
    identity = checkpoint.identity
    by_ref = {artifact.ref: artifact for artifact in graph}
    stages = [(0, identity["datasets"])]
    stages += [(stage["start_step"], stage["datasets"]) for stage in identity.get("stages", [])]
    ends = [start for start, _ in stages[1:]] + [identity["num_train_steps"]]
    reads: dict[str, list[int]] = {d["input"]: [] for d in identity["datasets"]}
    for (start, datasets), end in zip(stages, ends):
        weights = {d["input"]: d["weight"] for d in datasets}
        total = sum(weights.values())
        sequences = identity["batch_size"] * (end - start)
        for ref in reads:
            reads[ref].append(math.ceil(weights.get(ref, 0.0) / total * sequences))
    components = []
    for dataset in identity["datasets"]:
        cache = by_ref[dataset["input"]]
        per_stage = tuple(reads[cache.ref])
        components.append(
            ComponentBudget(
                cache=cache,
                weight=dataset["weight"],
                share=sum(per_stage) / (identity["batch_size"] * identity["num_train_steps"]),
                sequence_len=identity["seq_len"],
                sequences=sum(per_stage),
                holds=held.get(cache.ref, imported.get(cache.ref, cache.identity.get("max_tokens"))),
                built=cache.ref in held,
                imported=cache.ref not in held and cache.ref in imported,
                stage_sequences=per_stage if len(per_stage) > 1 else (),
                stage_starts=tuple(start for start, _ in stages) if len(stages) > 1 else (),
            )
        )
    return MixtureBudget(checkpoint, tuple(components))


def built_tokens(prefix: str, artifact: Artifact) -> Optional[int]:
    """The tokens of `artifact` if a local store holds it built, else None."""
    if "://" in prefix or stored_state(prefix, artifact).status != "built":
        return None
    try:
        with open(os.path.join(artifact_path(prefix, artifact), CACHE_INFO_FILE)) as f:
            return int(json.load(f)["tokens"])
    except (OSError, ValueError, KeyError):
        return None  # an imported or damaged cache: the runner's checks say what is wrong


def local_budgets(
    prefix: str, graph: ArtifactGraph, imported: Optional[Mapping[str, int]] = None
) -> list[MixtureBudget]:
    """The budget of every checkpoint in `graph`, built caches read from a local store; `imported`:
    the ledger tokens of imports not built yet."""
    held = {}
    for artifact in graph:
        if artifact.kind == "tokenized_cache":
            tokens = built_tokens(prefix, artifact)
            if tokens is not None:
                held[artifact.ref] = tokens
    return [
        mixture_budget(artifact, graph, held, imported)
        for artifact in graph
        if artifact.kind == "lm_checkpoint"
    ]


class MixtureTooSmall(Exception):
    pass


@dataclass(frozen=True)
class MixtureBudgetRequest:
    address: Address


@dataclass(frozen=True)
class MixtureFits:
    pass


@_uncacheable_rule(desc="Checking the training mixture's caches are big enough")
async def check_mixture_budget(
    request: MixtureBudgetRequest, kiln: KilnSubsystem, build_root: BuildRoot
) -> MixtureFits:
    """Uncacheable: built caches are read from the store, which changes behind Pants' back."""
    checkpoint, graph = await artifact_and_graph(request.address)
    budgets = local_budgets(kiln.prefix_location(build_root.path), graph)
    for budget in budgets:
        if budget.checkpoint == checkpoint and budget.refusal():
            raise MixtureTooSmall(budget.refusal())
    return MixtureFits()


def rules():
    return collect_rules()
