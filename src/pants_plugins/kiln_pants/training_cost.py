"""What a checkpoint's training costs, before it runs: parameters, tokens, FLOPs, device-hours and,
with `[kiln] price_per_device_hour`, money (`pants plan`, docs/sweeps.md).

FLOPs = D * (6 * N + 12 * L * T * H * Q): D tokens (batch_size x seq_len x num_train_steps), N
the weights of the matrix multiplies (the lm head included, the embedding lookup and norms not),
L layers, T seq_len, H heads of Q features (kiln_contract.llama.flops_per_token, the count the
trainer's MFU uses). Device-hours come from measured throughput (MEASURED_THROUGHPUT, the
rows of benchmarks/RESULTS.md "Training throughput per device"): a run is priced from a
measurement on its device type, in its compute dtype, of a model within COVERED_RATIO of its
parameter count, at that measurement's FLOP/s; with none, the plan says so instead of guessing.
A TPU chip no row was measured on is priced as an estimate: its peak bf16 FLOP/s at the MFU
measured on another TPU chip (the v5e's rows) for the nearest model.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any, Optional

from pants.engine.addresses import Address
from pants.engine.fs import Digest, DigestContents
from pants.engine.rules import Get, collect_rules, rule
from pants.engine.target import WrappedTarget, WrappedTargetRequest

from kiln_contract.llama import LlamaArchitecture, flops_per_token, num_parameters
from kiln_contract.location import in_bucket
from kiln_contract.tpu import TPU_PEAK_BF16_FLOPS, tpu_generation, tpu_slice_shape
from kiln_contract.train import Resources
from kiln_pants.artifact_graph import Artifact, TokenizerFiles, TokenizerFilesRequest
from kiln_pants.artifact_store import artifact_path, stored_state
from kiln_pants.cache_estimate import count, duration
from kiln_pants.mixture_budget import CACHE_INFO_FILE
from kiln_pants.target_types import TokenizerField, tokenizer_address


@dataclass(frozen=True)
class Throughput:
    """A measured training throughput: tokens/s per device of one model on one device type."""

    device: str  # a gpu(...)/tpu(...) type, or "cpu"
    model: LlamaArchitecture
    vocab_size: int
    seq_len: int
    compute_dtype: str
    tokens_per_second: float  # per device
    date: str
    section: str  # where benchmarks/RESULTS.md reports it

    @property
    def parameters(self) -> int:
        return num_parameters(self.model, self.vocab_size)

    @property
    def flops_per_second(self) -> float:
        return self.tokens_per_second * flops_per_token(self.model, self.vocab_size, self.seq_len)

    @property
    def mfu(self) -> float:
        """Of a TPU chip's peak bf16 FLOP/s, the share the measurement reached."""
        return self.flops_per_second / TPU_PEAK_BF16_FLOPS[self.device]

    def describe(self) -> str:
        return (
            f"{count(self.tokens_per_second)} tokens/s per device measured for "
            f"{count(self.parameters)} parameters on {self.device}, {self.date}"
        )


# The quickstart's layers (experiments:quickstart), with benchmarks/train_step.py's vocabulary of
# 1,024 ("tiny") and with the quickstart's of 8,192.
_QUICKSTART = LlamaArchitecture(max_seq_len=256, hidden_dim=128, intermediate_dim=512,
                                num_heads=4, num_kv_heads=2, num_layers=2)  # fmt: skip
_ONE_POINT_FOUR_B = LlamaArchitecture(max_seq_len=4096, hidden_dim=2048, intermediate_dim=8192,
                                      num_heads=16, num_kv_heads=16, num_layers=24)  # fmt: skip
# benchmarks/train_step.py's models for one TPU v5e (a 32,000-token vocabulary).
_V5E_150M = LlamaArchitecture(max_seq_len=2048, hidden_dim=768, intermediate_dim=3072,
                              num_heads=6, num_kv_heads=6, num_layers=12)  # fmt: skip
_V5E_470M = LlamaArchitecture(max_seq_len=2048, hidden_dim=1024, intermediate_dim=4096,
                              num_heads=8, num_kv_heads=8, num_layers=24)  # fmt: skip
_V5E_1B = LlamaArchitecture(max_seq_len=2048, hidden_dim=1536, intermediate_dim=6144,
                            num_heads=12, num_kv_heads=12, num_layers=24)  # fmt: skip
_V5E_SECTION = "The train step on one v5e"
MEASURED_THROUGHPUT = (
    Throughput("cpu", _QUICKSTART, 1024, 128, "float32", 7_500, "2026-11-29", "Train step"),
    Throughput("cpu", _QUICKSTART, 8192, 128, "float32", 5_200, "2026-11-30", "Quickstart"),
    Throughput("H200", _ONE_POINT_FOUR_B, 128256, 4096, "bfloat16", 35_104, "2026-11-30",
               "1.4B train step"),
    Throughput("v5litepod", _V5E_150M, 32000, 2048, "bfloat16", 107_754, "2026-12-06",
               _V5E_SECTION),
    Throughput("v5litepod", _V5E_470M, 32000, 2048, "bfloat16", 41_534, "2026-12-06",
               _V5E_SECTION),
    Throughput("v5litepod", _V5E_1B, 32000, 2048, "bfloat16", 15_975, "2026-12-06",
               _V5E_SECTION),
)  # fmt: skip
FLOPS_FORMULA = (
    "FLOPs = D x (6 N + 12 L T H Q): D tokens, N matmul weights (lm head included), L layers, "
    "T seq_len, H heads of Q features"
)
# A measurement prices models from a third to three times its parameter count.
COVERED_RATIO = 3.0


@dataclass(frozen=True)
class StartUp:
    """A measured trainer start: seconds from its process starting to its first step done
    (imports, opening the caches, initialising the state, compiling the step), cold."""

    device: str
    seconds: float
    date: str
    section: str  # where benchmarks/RESULTS.md reports it


# benchmarks/RESULTS.md "Start-up": the quickstart's trainer on the idle 2-core VM, cold start,
# median of three (no compilation cache).
MEASURED_START_UP = (
    StartUp("cpu", 7.7, "2026-12-01", "Start-up: the quickstart's trainer"),
)

# What a training adds per input cache before its first step: Pants placing an inline cache's
# files in the sandbox, the runner copying it into a local store and checking its digests, the
# trainer opening it and mixing it in. benchmarks/RESULTS.md "A training's caches, cache by
# cache": the slope of `build scale:big` between 100 and 1,000 one-document inline caches on the
# 2-core CPU VM, shared (2026-12-06). A bucket store copies and checks over the network: more.
SECONDS_PER_INPUT_CACHE = 0.037
INPUT_CACHES_SECTION = "A training's caches, cache by cache"

# Vocabularies of tokenizers that are not files in the repository.
KNOWN_VOCABULARIES = {
    ("package", "gpt2"): 50257,
    ("hf", "meta-llama/Meta-Llama-3.1-8B"): 128256,
    ("hf", "meta-llama/Meta-Llama-3-8B"): 128256,
    ("hf", "gpt2"): 50257,
}


@dataclass(frozen=True)
class RunCost:
    checkpoint: Artifact
    resources: Resources
    vocab_size: Optional[int]  # None: not known before the caches are built
    measurement: Optional[Throughput]
    unpriced: str  # why no measurement prices it (when none does)

    @property
    def caches(self) -> int:
        """The caches it opens, checks and places: its datasets and validation sets."""
        return len(set(self.checkpoint.cache_inputs))

    @property
    def device(self) -> str:
        return device_type(self.resources)

    @property
    def tokens(self) -> int:
        identity = self.checkpoint.identity
        return identity["batch_size"] * identity["seq_len"] * identity["num_train_steps"]

    @property
    def model(self) -> LlamaArchitecture:
        return LlamaArchitecture.from_json(self.checkpoint.identity["model"])

    @property
    def parameters(self) -> Optional[int]:
        return None if self.vocab_size is None else num_parameters(self.model, self.vocab_size)

    @property
    def flops(self) -> Optional[float]:
        if self.vocab_size is None:
            return None
        seq_len = self.checkpoint.identity["seq_len"]
        return self.tokens * flops_per_token(self.model, self.vocab_size, seq_len)

    @property
    def estimated(self) -> bool:
        """Priced from a measurement on another TPU chip, at its MFU on this chip's peak."""
        return self.measurement is not None and self.measurement.device != self.device

    @property
    def flops_per_second(self) -> Optional[float]:
        """Per device, as measured, or estimated from the measurement's MFU."""
        if self.measurement is None:
            return None
        if self.estimated:
            return self.measurement.mfu * TPU_PEAK_BF16_FLOPS[self.device]
        return self.measurement.flops_per_second

    @property
    def device_hours(self) -> Optional[float]:
        if self.flops_per_second is None or self.flops is None:
            return None
        return self.flops / self.flops_per_second / 3600

    @property
    def step_hours(self) -> Optional[float]:
        """The steps' time on the run's devices (None: unpriced)."""
        devices = device_count(self.resources)
        hours = self.device_hours
        return None if hours is None or not devices else hours / devices

    @property
    def caches_seconds(self) -> float:
        return self.caches * SECONDS_PER_INPUT_CACHE

    @property
    def wall_hours(self) -> Optional[float]:
        """The steps, the measured start-up (where there is one) and the caches."""
        steps = self.step_hours
        if steps is None:
            return None
        start = start_up(self.device)
        return steps + ((start.seconds if start else 0.0) + self.caches_seconds) / 3600

    def to_json(self, prices: dict[str, float]) -> dict[str, Any]:
        """What `describe` says, as data (`plan --plan-json`); None where it is not known."""
        hours, measurement = self.device_hours, self.measurement
        price = prices.get(self.device)
        start = start_up(self.device)
        return {
            "device": self.device,
            "parameters": self.parameters,
            "tokens": self.tokens,
            "flops": self.flops,
            "device_hours": hours,
            "cost": None if hours is None or not price else hours * price,
            "measured": None if measurement is None else measurement.section,
            "estimated_from": measurement.device if measurement and self.estimated else None,
            "unpriced": self.unpriced if hours is None else None,
            "input_caches": self.caches,
            "caches_seconds": self.caches_seconds,
            "start_up_seconds": None if start is None else start.seconds,
            "wall_hours": self.wall_hours,
        }

    def describe(self, prices: dict[str, float]) -> list[str]:
        if self.vocab_size is None:
            return [
                f"{self.checkpoint.ref}: {count(self.tokens)} tokens; parameters and FLOPs "
                "unknown until its caches are built (the tokenizer's vocabulary is not known)"
            ]
        line = (
            f"{self.checkpoint.ref}: {count(self.parameters or 0)} parameters, "
            f"{count(self.tokens)} tokens, {flops_text(self.flops or 0.0)} FLOPs"
        )
        hours = self.device_hours
        if hours is None or self.measurement is None:
            return [line, f"    device-hours unknown: {self.unpriced}"]
        steps, devices = self.step_hours, device_count(self.resources)
        on = f" (steps: {duration(steps)} on {devices} device(s))" if steps is not None else ""
        lines = [
            line,
            f"    {'~' if self.estimated else ''}{hours:.3g} {self.device} device-hours{on}"
            f"{money(hours, prices.get(self.device))}",
            f"    {self._rate()} (benchmarks/RESULTS.md, \"{self.measurement.section}\"), "
            "scaled by FLOPs per token",
        ]
        return lines + [f"    {line}" for line in self.wall_lines()]

    def _rate(self) -> str:
        assert self.measurement is not None
        if not self.estimated:
            return f"at {self.measurement.describe()}"
        return (
            f"an estimate: {self.device}'s peak {TPU_PEAK_BF16_FLOPS[self.device] / 1e12:g} "
            f"TFLOP/s bf16 at the {self.measurement.mfu:.1%} MFU of "
            f"{self.measurement.describe()}"
        )

    def wall_lines(self) -> list[str]:
        """The wall time and its parts: the steps, the start to the first step, the caches."""
        steps, wall = self.step_hours, self.wall_hours
        if steps is None or wall is None:
            return []
        start = start_up(self.device)
        caches = (
            f"  + {duration(self.caches_seconds / 3600)}: {self.caches:,} input cache(s) opened, "
            f"checked and placed, {SECONDS_PER_INPUT_CACHE:g} s each (benchmarks/RESULTS.md, "
            f"\"{INPUT_CACHES_SECTION}\")"
        )
        if start is None:
            return [
                f"wall ~ {duration(wall)} and a start-up not measured on {self.device}:",
                f"  {duration(steps)} of steps",
                caches,
            ]
        return [
            f"wall ~ {duration(wall)} (the runtime's build and the evaluations not included):",
            f"  {duration(steps)} of steps",
            f"  + {start.seconds:g} s to the first step (start-up and compile, measured on "
            f"{self.device} {start.date}, benchmarks/RESULTS.md, \"{start.section}\")",
            caches,
        ]


def start_up(device: str) -> Optional[StartUp]:
    return next((s for s in MEASURED_START_UP if s.device == device), None)


def flops_text(flops: float) -> str:
    return f"{flops:.3g}".replace("e+", "e")


def money(hours: float, price: Optional[float]) -> str:
    return f"; {hours * price:,.2f} at {price:g} per device-hour" if price else ""


def device_type(resources: Resources) -> str:
    """What a device-hour is of: a GPU model, a TPU chip's generation (v4, v5litepod), cpu."""
    if resources.kind == "tpu":
        return tpu_generation(str(resources.type))
    return "cpu" if resources.kind == "cpu" else str(resources.type)


def device_count(resources: Resources) -> Optional[int]:
    """Devices of a run: GPUs per host times hosts; a TPU slice's chips; a jax CPU device per
    host."""
    hosts = resources.hosts or 1
    if resources.kind == "gpu":
        return (resources.count or 1) * hosts
    if resources.kind == "tpu":
        return tpu_slice_shape(str(resources.type)).chips
    return hosts


def measurement_for(
    device: str, compute_dtype: str, parameters: int
) -> tuple[Optional[Throughput], str]:
    """The measurement nearest in size that covers a run, or None and why none does."""
    on_device = [m for m in MEASURED_THROUGHPUT if m.device == device]
    if not on_device and device in TPU_PEAK_BF16_FLOPS:  # another TPU chip's MFU: an estimate
        on_device = [m for m in MEASURED_THROUGHPUT if m.device in TPU_PEAK_BF16_FLOPS]
    if not on_device:
        measured = ", ".join(sorted({m.device for m in MEASURED_THROUGHPUT}))
        return None, f"no throughput measured on {device} (measured: {measured})"
    in_dtype = [m for m in on_device if m.compute_dtype == compute_dtype]
    if not in_dtype:
        return None, f"no {compute_dtype} throughput measured on {device}"
    nearest = min(in_dtype, key=lambda m: abs(math.log(parameters / m.parameters)))
    if not 1 / COVERED_RATIO <= parameters / nearest.parameters <= COVERED_RATIO:
        sizes = ", ".join(count(m.parameters) for m in in_dtype)
        return None, (
            f"no {compute_dtype} measurement on {device} within {COVERED_RATIO:g}x of "
            f"{count(parameters)} parameters (measured: {sizes})"
        )
    return nearest, ""


def run_cost(checkpoint: Artifact, resources: Resources, vocab_size: Optional[int]) -> RunCost:
    if vocab_size is None:
        return RunCost(checkpoint, resources, None, None, "the vocabulary is not known")
    model = LlamaArchitecture.from_json(checkpoint.identity["model"])
    measurement, why = measurement_for(
        device_type(resources),
        checkpoint.identity["compute_dtype"],
        num_parameters(model, vocab_size),
    )
    return RunCost(checkpoint, resources, vocab_size, measurement, why)


def total_lines(costs: list[RunCost], prices: dict[str, float]) -> list[str]:
    """The sum over the runs, per device type, and the runs no measurement prices."""
    flops = sum(c.flops or 0.0 for c in costs)
    lines = [f"Total of {len(costs)} run(s): {count(sum(c.tokens for c in costs))} tokens, "
             f"{flops_text(flops)} FLOPs"]  # fmt: skip
    for device in sorted({c.device for c in costs if c.device_hours is not None}):
        hours = sum(c.device_hours or 0.0 for c in costs if c.device == device)
        lines.append(f"  {hours:.3g} {device} device-hours{money(hours, prices.get(device))}")
    unpriced = [c for c in costs if c.device_hours is None]
    if unpriced:
        lines.append(f"  {len(unpriced)} run(s) not priced: no measurement covers them (above)")
    return lines


def stored_vocabulary(prefix: str, cache: Artifact) -> Optional[int]:
    """The vocabulary a built cache in a local store records (cache.json)."""
    if in_bucket(prefix) or stored_state(prefix, cache).status != "built":
        return None
    try:
        with open(os.path.join(artifact_path(prefix, cache), CACHE_INFO_FILE)) as f:
            return int(json.load(f)["tokenizer"]["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


@dataclass(frozen=True)
class VocabularyRequest:
    cache: Address


@dataclass(frozen=True)
class Vocabulary:
    size: Optional[int]  # None: not known before the cache is built


@rule(desc="Finding a cache's tokenizer vocabulary")
async def tokenizer_vocabulary(request: VocabularyRequest) -> Vocabulary:
    """From the tokenizer's files in the repository (tokenizer.json), or a known tokenizer."""
    wrapped = await Get(
        WrappedTarget, WrappedTargetRequest(request.cache, description_of_origin="<kiln plan>")
    )
    tokenizer = wrapped.target[TokenizerField].value
    if not tokenizer_address(tokenizer):
        kind, _, name = tokenizer.partition(":") if tokenizer.startswith("package:") else (
            "hf", "", tokenizer)  # fmt: skip
        return Vocabulary(KNOWN_VOCABULARIES.get((kind, name)))
    files = await Get(TokenizerFiles, TokenizerFilesRequest(request.cache, tokenizer))
    return await Get(Vocabulary, TokenizerFiles, files)


@rule(desc="Reading a tokenizer's vocabulary size")
async def vocabulary_of_files(files: TokenizerFiles) -> Vocabulary:
    """Once per tokenizer: the caches that share it (a thousand, in an ablation) share this."""
    contents = await Get(DigestContents, Digest, files.digest)
    for content in contents:
        if content.path == f"{files.directory}/tokenizer.json":
            try:
                return Vocabulary(vocabulary_size(json.loads(content.content)))
            except ValueError:
                return Vocabulary(None)
    return Vocabulary(None)


def vocabulary_size(tokenizer_json: Any) -> Optional[int]:
    """The ids a `tokenizers` tokenizer.json defines: its model's vocabulary and added tokens;
    None for a file of another shape (the build says what is wrong with it)."""
    model = tokenizer_json.get("model") if isinstance(tokenizer_json, dict) else None
    vocab = model.get("vocab") if isinstance(model, dict) else None
    ids = list(vocab.values()) if isinstance(vocab, dict) else []
    ids += list(range(len(vocab))) if isinstance(vocab, list) else []  # a unigram model
    added = tokenizer_json.get("added_tokens") if isinstance(tokenizer_json, dict) else None
    ids += [t["id"] for t in added or [] if isinstance(t, dict) and isinstance(t.get("id"), int)]
    if not ids or not all(isinstance(i, int) for i in ids):
        return None
    return max(ids) + 1


def rules():
    return collect_rules()
