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
from typing import Any, Optional

from pants.base.build_root import BuildRoot
from pants.engine.addresses import Address
from pants.engine.rules import _uncacheable_rule, collect_rules

from kiln_contract.location import in_bucket
from kiln_contract.tokenize import LOSS_TOKENS
from kiln_pants.artifact_graph import Artifact, ArtifactGraph, artifact_and_graph
from kiln_pants.artifact_store import artifact_path, stored_state
from kiln_pants.cache_estimate import count, most_tokens
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
    stage_weights: tuple[float, ...] = ()  # with stages: the weight in each
    # For a run started from a run of the graph: how much of this cache's stream (sequences
    # from its beginning) its parent (and theirs) read up to where the run starts; 0 for a
    # cache new to the run's line.
    read_before: Optional[int] = None
    continued: bool = False  # the parent's line read this cache: the run reads on in its stream
    stream_start: int = 0  # where the run's stream of this cache starts: the parent's position
    at_most: Optional[int] = None  # unbuilt: a bound on its tokens, its files' bytes
    # A built chat or supervised cache: the share of its tokens the loss counts (masked in).
    masked_in: Optional[float] = None

    @property
    def reads(self) -> int:
        return self.sequences * self.sequence_len

    @property
    def masked(self) -> bool:
        """A chat or supervised cache: its loss counts its masked-in tokens alone."""
        return "document_format" in self.cache.identity

    @property
    def trains(self) -> Optional[int]:
        """Of the tokens read, about how many the loss counts (all of a text cache's)."""
        if not self.masked:
            return self.reads
        return None if self.masked_in is None else round(self.reads * self.masked_in)

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

    @property
    def under_one_window(self) -> Optional[str]:
        """Why the cache cannot give one window of seq_len tokens (which the mixture needs of
        each of its caches), when its count or its estimate decides it; else None."""
        if self.holds is not None and self.holds < self.sequence_len:
            return f"holds {count(self.holds)} tokens"
        if self.holds is None and self.at_most is not None and self.at_most < self.sequence_len:
            return f"its files hold {self.at_most} bytes, so at most as many tokens"
        return None

    def describe(self) -> str:
        if self.holds is None:
            holds = "holds the whole source (unknown until built)"
        elif self.built:
            holds = f"holds {count(self.holds)} (built)"
        elif self.imported:
            holds = f"holds {count(self.holds)} (its shard_ledger.json)"
        else:
            holds = f"will hold >= {count(self.holds)} (max_tokens)"
        weights = " -> ".join(f"{w:g}" for w in self.stage_weights or (self.weight,))
        line = (
            f"{self.cache.ref:<48} weight{'s' if self.stage_weights else ''} {weights} "
            f"({self.share:.1%}{' of the run' if self.stage_weights else ''}): reads "
            f"{count(self.reads)} tokens{self._by_stage()}{self._trained()}, {holds}"
            f"{self._new_and_reread()}"
        )
        if self.under_one_window:
            return (f"{line}\n    !! {self.under_one_window}, less than one window of "
                    f"seq_len={self.sequence_len}: add documents to {self.cache.address} or "
                    "leave it out of the mixture")  # fmt: skip
        if self.too_small:
            return f"{line}\n    !! too small for its share: raise `max_tokens` on {self.cache.address}"
        if self.epochs is not None and self.epochs > 1:
            return f"{line}; read {self.epochs:.1f} times"
        return line

    def new_tokens(self) -> Optional[int]:
        """Of what a run continuing its parent's stream reads, the tokens its line never read
        (the stream's first pass over the cache's windows); None when not known."""
        if self.read_before is None or self.holds is None:
            return None
        windows = max(self.holds // self.sequence_len, 1)
        first_pass_end = min(self.stream_start + self.sequences, windows)
        read = max(self.stream_start, min(self.read_before, windows))
        return max(0, first_pass_end - read) * self.sequence_len

    def to_json(self) -> dict[str, Any]:
        """What `describe` says, as data (`plan --plan-json`)."""
        new = self.new_tokens()
        return {
            "cache": self.cache.ref,
            "weights": list(self.stage_weights or (self.weight,)),
            "share": self.share,
            "reads_tokens": self.reads,
            "trains_tokens": self.trains,
            "stages": [{"start_step": start, "tokens": n * self.sequence_len}
                       for start, n in zip(self.stage_starts, self.stage_sequences)],  # fmt: skip
            "holds_tokens": self.holds,
            "built": self.built,
            "epochs": self.epochs,
            "continues_at_sequence": self.stream_start if self.continued else None,
            "read_before_sequences": self.read_before,
            "new_tokens": new,
            "reread_tokens": None if new is None else self.reads - new,
            "problem": self.under_one_window or ("too small for its share" if self.too_small
                                                 else None),  # fmt: skip
        }

    def _new_and_reread(self) -> str:
        """Of what the run reads, the tokens no run of its line read before and the re-read
        ones: the stream's first pass over the cache's windows is new, the rest repeats."""
        if self.read_before is None:
            return ""
        start, end = self.stream_start, self.stream_start + self.sequences
        if self.continued:
            where = f"; continues its parent's stream at sequence {start}"
        elif self.read_before:
            where = (f"; reads its stream from the beginning, of which its line read "
                     f"{self.read_before} sequences")  # fmt: skip
        else:
            where = "; new to its parent's line"
        new = self.new_tokens()
        if new is None:
            return f"{where} (new while the cache holds more than {end} windows)"
        return f"{where}: {count(new)} new, {count(self.reads - new)} re-read"

    def _trained(self) -> str:
        """A chat or supervised cache's trained tokens: those of its reads the loss counts."""
        if not self.masked:
            return ""
        if self.trains is None or self.masked_in is None:
            return " (trains on its masked-in tokens alone: their share is known once built)"
        return f" (trains on ~{count(self.trains)}: {self.masked_in:.0%} masked in)"

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
    parent_step: Optional[int] = None  # the step of its parent run it starts from, if any

    @property
    def tokens(self) -> int:
        identity = self.checkpoint.identity
        return identity["batch_size"] * identity["seq_len"] * identity["num_train_steps"]

    def header(self) -> str:
        identity = self.checkpoint.identity
        line = (
            f"Training data of {self.checkpoint.ref}: {identity['batch_size']} x "
            f"{identity['seq_len']} tokens x {identity['num_train_steps']} steps = "
            f"{count(self.tokens)} tokens"
        )
        parent = identity.get("init_from") or {}
        if "fingerprint" not in parent:  # random or published weights
            return line
        at = "its final step" if parent.get("step") is None else f"step {parent['step']}"
        carries = "weights and Adam's moments" if parent.get("optimizer_state") else "weights"
        data = ("continuing its data stream" if parent.get("data_continues")
                else "its datasets from their beginning")  # fmt: skip
        return (f"{line}\n  starts from {parent['name']}@{parent['version']} at {at} "
                f"({carries}), {data}")  # fmt: skip

    def to_json(self) -> dict[str, Any]:
        """What the plan says of the run's training data, as data (`plan --plan-json`)."""
        identity = self.checkpoint.identity
        return {
            "checkpoint": self.checkpoint.ref,
            "batch_size": identity["batch_size"],
            "seq_len": identity["seq_len"],
            "num_train_steps": identity["num_train_steps"],
            "tokens": self.tokens,
            "init_from": self._parent_json(),
            "datasets": [component.to_json() for component in self.components],
            "refusal": self.refusal(),
        }

    def _parent_json(self) -> Optional[dict[str, Any]]:
        """The identity's `init_from`, with what it leaves out (a false flag, the parent's final
        step) said: `data_continues`, `optimizer_state`, `step`."""
        parent = self.checkpoint.identity.get("init_from")
        if not parent or "fingerprint" not in parent:  # random or published weights
            return parent
        flags = {key: bool(parent.get(key)) for key in ("data_continues", "optimizer_state")}
        return {**parent, **flags, "step": self.parent_step}

    def refusal(self) -> Optional[str]:
        """The error for caches too small for their share or for one window, or None."""
        tiny = [c for c in self.components if c.under_one_window]
        if tiny:
            lines = "\n".join(f"  {c.describe()}" for c in tiny)
            return (
                f"{self.checkpoint.address} reads windows of {tiny[0].sequence_len} tokens, and "
                f"these caches cannot give one, so the run would fail; nothing was built:\n{lines}"
            )
        small = [c for c in self.components if c.too_small]
        if not small:
            return None
        lines = "\n".join(f"  {c.describe()}" for c in small)
        return (
            f"{self.checkpoint.address} reads more tokens from these caches than their "
            f"`max_tokens` gives them, so it would repeat their data; nothing was built:\n{lines}"
        )


def mixture_budget(
    checkpoint: Artifact,
    graph: ArtifactGraph,
    held: Mapping[str, int],
    imported: Optional[Mapping[str, int]] = None,
    bounds: Optional[Mapping[str, int]] = None,
    masked_in: Optional[Mapping[str, float]] = None,
) -> MixtureBudget:
    """The budget of `checkpoint`'s datasets; `held` maps a built cache's ref to its tokens,
    `imported` an unbuilt import's ref to its ledger's, `bounds` an unbuilt cache's to the most
    tokens its files can give, `masked_in` a built chat or supervised cache's to the share of
    its tokens the loss counts. A mixture with stages reads each stage's steps by that stage's
    weights."""
    imported, bounds, masked_in = imported or {}, bounds or {}, masked_in or {}
    identity = checkpoint.identity
    by_ref = {artifact.ref: artifact for artifact in graph}
    stages = _stages(identity)
    reads = _reads(identity, stages, identity["num_train_steps"])
    lineage = _lineage(checkpoint, by_ref)
    continues = bool((identity.get("init_from") or {}).get("data_continues"))
    components = []
    for dataset in identity["datasets"]:
        cache = by_ref[dataset["input"]]
        per_stage = tuple(reads[cache.ref])
        weights = tuple(
            next((d["weight"] for d in datasets if d["input"] == cache.ref), 0.0)
            for _, datasets in stages
        )
        components.append(
            ComponentBudget(
                cache=cache,
                weight=dataset["weight"],
                share=_share(identity, stages, cache.ref),
                sequence_len=identity["seq_len"],
                sequences=sum(per_stage),
                holds=held.get(cache.ref, imported.get(cache.ref, cache.identity.get("max_tokens"))),
                built=cache.ref in held,
                imported=cache.ref not in held and cache.ref in imported,
                stage_sequences=per_stage if len(per_stage) > 1 else (),
                stage_starts=tuple(start for start, _ in stages) if len(stages) > 1 else (),
                stage_weights=weights if len(stages) > 1 else (),
                read_before=None if lineage is None else lineage.read.get(cache.ref, 0),
                continued=continues and lineage is not None and cache.ref in lineage.ends,
                stream_start=lineage.ends.get(cache.ref, 0) if continues and lineage else 0,
                at_most=bounds.get(cache.ref),
                masked_in=masked_in.get(cache.ref),
            )
        )
    return MixtureBudget(checkpoint, tuple(components), lineage.step if lineage else None)


def _share(identity: Mapping, stages: list[tuple[int, list]], ref: str) -> float:
    """The cache's share of the run's sequences by the weights, before whole sequences."""
    starts = [start for start, _ in stages] + [identity["num_train_steps"]]
    share = 0.0
    for (start, datasets), end in zip(stages, starts[1:]):
        weights = {d["input"]: d["weight"] for d in datasets}
        share += weights.get(ref, 0.0) / sum(weights.values()) * (end - start)
    return share / identity["num_train_steps"]


def _stages(identity: Mapping) -> list[tuple[int, list]]:
    """(first step, datasets) of each stage of a run's mixture, stage 0 first."""
    stages = [(0, identity["datasets"])]
    return stages + [(stage["start_step"], stage["datasets"]) for stage in identity.get("stages", [])]


def _reads(identity: Mapping, stages: list[tuple[int, list]], until: int) -> dict[str, list[int]]:
    """The sequences each cache gives each stage in the run's steps before `until`."""
    starts = [start for start, _ in stages]
    ends = [min(end, until) for end in [*starts[1:], identity["num_train_steps"]]]
    reads: dict[str, list[int]] = {d["input"]: [] for d in identity["datasets"]}
    for (start, datasets), end in zip(stages, ends):
        weights = {ref: 0.0 for ref in reads}
        weights.update({d["input"]: d["weight"] for d in datasets})
        counts = apportion(weights, identity["batch_size"] * max(0, end - start))
        for ref in reads:
            reads[ref].append(counts[ref])
    return reads


def apportion(weights: Mapping[str, float], sequences: int) -> dict[str, int]:
    """`sequences` shared by weight in whole sequences that add up to it (the largest
    remainders round up, ties in order): a thousand small shares do not each round up to one."""
    total = sum(weights.values())
    exact = {ref: weight / total * sequences for ref, weight in weights.items()}
    counts = {ref: math.floor(value) for ref, value in exact.items()}
    left = sequences - sum(counts.values())
    by_remainder = sorted(exact, key=lambda ref: counts[ref] - exact[ref])  # stable: in order
    for ref in by_remainder[:left]:
        counts[ref] += 1
    return counts


@dataclass(frozen=True)
class Lineage:
    """What the runs a run starts from read of each cache's stream, in sequences, up to the step
    it starts from: where its parent's stream stopped (`ends`: a continuing run reads on from
    there) and how much of the stream, from its beginning, the line read (`read`: more than
    `ends` where a run of the line started its datasets afresh)."""

    step: int  # of the parent, where the run starts
    ends: dict[str, int]
    read: dict[str, int]


def _lineage(checkpoint: Artifact, by_ref: Mapping[str, Artifact]) -> Optional[Lineage]:
    """The lineage of a run started from a run of the graph; None for any other start."""
    parent_run = checkpoint.identity.get("init_from") or {}
    parent = by_ref.get(f"{parent_run.get('name')}@{parent_run.get('version')}")
    if parent is None or "num_train_steps" not in parent.identity:  # no run: an export
        return None
    identity = parent.identity
    step = parent_run.get("step")
    until = identity["num_train_steps"] if step is None else step
    own = _reads(identity, _stages(identity), until)
    earlier = _lineage(parent, by_ref)
    continues = bool((identity.get("init_from") or {}).get("data_continues"))
    starts = earlier.ends if earlier and continues else {}
    ends = {ref: starts.get(ref, 0) + sum(n) for ref, n in own.items()}
    read = dict(earlier.read) if earlier else {}
    for ref, end in ends.items():
        read[ref] = max(read.get(ref, 0), end)
    return Lineage(until, ends, read)


def built_tokens(prefix: str, artifact: Artifact) -> Optional[tuple[int, Optional[int]]]:
    """The tokens of `artifact` and, for a chat or supervised cache, those its loss counts, if
    a local store holds it built; else None."""
    if in_bucket(prefix) or stored_state(prefix, artifact).status != "built":
        return None
    try:
        with open(os.path.join(artifact_path(prefix, artifact), CACHE_INFO_FILE)) as f:
            info = json.load(f)
        loss_tokens = info.get(LOSS_TOKENS)
        return int(info["tokens"]), None if loss_tokens is None else int(loss_tokens)
    except (OSError, ValueError, KeyError, TypeError):
        return None  # an imported or damaged cache: the runner's checks say what is wrong


def local_budgets(
    prefix: str,
    graph: ArtifactGraph,
    build_root: str,
    imported: Optional[Mapping[str, int]] = None,
) -> list[MixtureBudget]:
    """The budget of every checkpoint in `graph`, built caches read from a local store, unbuilt
    ones of local files bounded by their size (`build_root`: where repo files are); `imported`:
    the ledger tokens of imports not built yet."""
    held, bounds, masked_in = {}, {}, {}
    for artifact in graph:
        if artifact.kind == "tokenized_cache":
            built = built_tokens(prefix, artifact)
            if built is not None:
                held[artifact.ref], loss_tokens = built
                if loss_tokens is not None:
                    masked_in[artifact.ref] = loss_tokens / max(built[0], 1)
            elif (most := most_tokens(artifact, build_root)) is not None:
                bounds[artifact.ref] = most
    return [
        mixture_budget(artifact, graph, held, imported, bounds, masked_in)
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
    budgets = local_budgets(kiln.prefix_location(build_root.path), graph, build_root.path)
    for budget in budgets:
        if budget.checkpoint == checkpoint and budget.refusal():
            raise MixtureTooSmall(budget.refusal())
    return MixtureFits()


def rules():
    return collect_rules()
