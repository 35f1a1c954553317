"""The artifact graph: each artifact target's identity config and fingerprint, inputs first.

`Get(ArtifactGraph, ArtifactGraphRequest(addresses))` walks the transitive closure of the given
targets. An artifact's identity is the JSON of its identity-bearing fields (literals only), with
each input replaced by `name@version` and its fingerprint; files in the repo (local sources, a
tokenizer directory) contribute their content digest, not their paths on this machine. A graph
in which a target shares its artifact name and version with another target of the repository is
refused (kiln_pants.artifact_folders).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional, Union

from pants.core.util_rules.source_files import SourceFiles, SourceFilesRequest
from pants.engine.addresses import Address, Addresses
from pants.engine.collection import Collection
from pants.engine.fs import Digest
from pants.engine.rules import Get, MultiGet, collect_rules, rule
from pants.engine.target import (
    Field,
    InvalidFieldException,
    SourcesField,
    Target,
    TransitiveTargets,
    TransitiveTargetsRequest,
    WrappedTarget,
    WrappedTargetRequest,
)

from kiln_contract.llama import weights_differences
from kiln_contract.tokenize import (
    DEFAULT_DOCUMENT_FORMAT,
    DEFAULT_FRAMING,
    FORMAT_ENCODINGS,
    LevanterCacheSource,
    UrlFilesSource,
)
from kiln_contract.train import HfModelSource, ParentRun
from kiln_contract.vocabulary import is_mutable_version
from kiln_pants.artifact_folders import ArtifactFolders, refuse_shared_folders
from kiln_pants.dependency_inference import field_address_inputs
from kiln_pants.eval_targets import (
    EvalBatchesField,
    EvalBatchSizeField,
    EvalComputeDtypeField,
    EvalModelField,
    EvalSeqLenField,
    EvalSuiteField,
    EvalValidationField,
    LmEvalRunTarget,
)
from kiln_pants.field_problems import check_target
from kiln_pants.field_values import CheckpointInit, EvalSuite
from kiln_pants.fingerprint import canonical_json, fingerprint
from kiln_pants.hf_model_targets import (
    CheckpointField,
    ExportDtypeField,
    ExportStepField,
    HfModelTarget,
)
from kiln_pants.target_types import (
    STDLIB_SOURCES,
    ArtifactVersionField,
    BatchSizeField,
    CacheSourceField,
    CacheSourcesField,
    CacheStorageField,
    CheckpointEveryField,
    ComputeDtypeField,
    DataOrderField,
    DatasetsField,
    EvalsField,
    FramingField,
    HfDataFilesField,
    HfRevisionField,
    HfSubsetField,
    InitFromField,
    LmCheckpointTarget,
    LossPositionsField,
    MaxDocumentCharsField,
    MaxTokensField,
    ModelField,
    NumShardsField,
    NumTrainStepsField,
    OptimizerField,
    RecordFilterField,
    SeedField,
    SeqLenField,
    SplitField,
    TextKeyField,
    TokenizedCacheTarget,
    TokenizerField,
    ValidationField,
    ZLossWeightField,
    default_artifact_name,
    document_format,
    tokenizer_address,
    tokenizer_directory,
)

# Bump when the meaning of an identity config changes (it changes every fingerprint).
IDENTITY_FORMAT = 1


@dataclass(frozen=True)
class Artifact:
    address: Address
    kind: str  # the target alias: tokenized_cache | lm_checkpoint | hf_model
    name: str
    version: str
    identity_json: str  # canonical JSON of the identity config
    fingerprint: str
    inputs: tuple[Address, ...]  # a checkpoint's: its datasets, validation sets, then parent
    # Its files live in the artifact store; False: an inline cache, whose files are outputs of
    # Pants processes (and Pants' cache serves them).
    in_store: bool = True
    parent: Optional[Address] = None  # the run (or export) a checkpoint starts from: init_from

    @property
    def identity(self) -> dict[str, Any]:
        return json.loads(self.identity_json)

    @property
    def ref(self) -> str:
        return f"{self.name}@{self.version}"

    @property
    def folder(self) -> str:
        """`{name}/{version}`: the artifact's folder under the store's root (or dist/)."""
        return f"{self.name}/{self.version}"

    @property
    def mutable(self) -> bool:
        return is_mutable_version(self.version)

    @property
    def cache_inputs(self) -> tuple[Address, ...]:
        """A checkpoint's caches: its datasets in declaration order, then its validation sets."""
        return tuple(a for a in self.inputs if a != self.parent)


class ArtifactGraph(Collection[Artifact]):
    """Artifacts in build order: every artifact after its inputs."""

    def get(self, address: Address) -> Artifact:
        for artifact in self:
            if artifact.address == address:
                return artifact
        raise KeyError(address)


@dataclass(frozen=True)
class TokenizerFiles:
    """A tokenizer directory from a `files`/`resources` target."""

    digest: Digest
    directory: str  # repo-relative directory holding tokenizer.json


@dataclass(frozen=True)
class TokenizerFilesRequest:
    cache: Address
    tokenizer: str  # the address string from the `tokenizer` field


@dataclass(frozen=True)
class ReferencedFilesRequest:
    """The files of a target named by address in a field (a tokenizer, eval task YAML)."""

    owner: Address
    address: str
    field_alias: str


@dataclass(frozen=True)
class ReferencedFiles:
    """The `SourceFiles` a field names, in a result type of its own (docs/architecture.md)."""

    sources: SourceFiles


@rule(desc="Collecting referenced files")
async def referenced_files(request: ReferencedFilesRequest) -> ReferencedFiles:
    addresses = await Get(
        Addresses, field_address_inputs(request.owner, request.field_alias, [request.address])
    )
    closure = await Get(TransitiveTargets, TransitiveTargetsRequest(addresses))
    sources = await Get(
        SourceFiles,
        SourceFilesRequest([t[SourcesField] for t in closure.closure if t.has_field(SourcesField)]),
    )
    return ReferencedFiles(sources)


@rule(desc="Collecting a tokenizer's files")
async def tokenizer_files(request: TokenizerFilesRequest) -> TokenizerFiles:
    sources = (await Get(
        ReferencedFiles, ReferencedFilesRequest(request.cache, request.tokenizer, "tokenizer")
    )).sources
    directories = {f.rsplit("/", 1)[0] for f in sources.files if f.endswith("/tokenizer.json")}
    if len(directories) != 1:
        raise InvalidFieldException(
            f"The `tokenizer` field in target {request.cache} refers to {request.tokenizer}, "
            f"which must own exactly one directory with a tokenizer.json; found "
            f"{sorted(directories) or 'none'} among {len(sources.files)} files."
        )
    return TokenizerFiles(sources.snapshot.digest, directories.pop())


async def _cache_identity(target: Target) -> dict[str, Any]:
    """A cache is its source, its tokenizer and how documents become windows."""
    identity = {
        "kind": TokenizedCacheTarget.alias,
        "format": IDENTITY_FORMAT,
        "source": await _source_identity(target),
        "tokenizer": await _tokenizer_identity(target),
        "text_key": target[TextKeyField].value,
        "max_document_chars": target[MaxDocumentCharsField].value,
        "num_shards": target[NumShardsField].value,
    }
    max_tokens = target[MaxTokensField].value
    if max_tokens is not None:  # only when set: fingerprints of unbounded caches are unchanged
        identity["max_tokens"] = max_tokens
    framing = target[FramingField].value
    if framing != DEFAULT_FRAMING:  # likewise: caches in Kiln's framing keep their fingerprints
        identity["framing"] = framing
    structured = document_format(target)
    if structured["format"] in FORMAT_ENCODINGS:  # only there: other formats keep theirs
        structured["encoding"] = FORMAT_ENCODINGS[structured["format"]]
    if structured["format"] != DEFAULT_DOCUMENT_FORMAT:  # likewise: text caches keep theirs
        identity["document_format"] = structured
    return identity


async def _source_identity(target: Target) -> dict[str, Any]:
    """What a cache reads, each kind pinned as well as it can be, and its record filter."""
    source = target[CacheSourceField].value
    identity: dict[str, Any]
    if source is None:
        files = await Get(SourceFiles, SourceFilesRequest([target[CacheSourcesField]]))
        identity = {
            "kind": "files",
            "files": sorted(files.files),
            "digest": files.snapshot.digest.fingerprint,
        }
    elif isinstance(source, (LevanterCacheSource, UrlFilesSource)):
        # Pinned by content: a Levanter cache on import (docs/token-cache.md), downloads by their
        # digests; either refused when it differs.
        identity = source.to_json()
    elif source in STDLIB_SOURCES:
        # The runtime is pinned to CPython 3.12 (3rdparty/python): its docs are the text.
        identity = {
            "kind": "python_stdlib",
            "part": source.split(":", 1)[1],
            "split": target[SplitField].value,
            "python": "3.12",
        }
    elif source.startswith("/"):
        # Files outside the repo are identified by path: bump the version when they change.
        identity = {"kind": "files", "paths": [source]}
    else:
        identity = _hub_identity(target, source)
    where = target[RecordFilterField].value
    if where:
        identity["where"] = dict(sorted(where.items()))
    return identity


def _hub_identity(target: Target, dataset: str) -> dict[str, Any]:
    identity: dict[str, Any] = {
        "kind": "hf",
        "id": dataset,
        "revision": target[HfRevisionField].value,
        "subset": target[HfSubsetField].value,
        "split": target[SplitField].value,
    }
    data_files = target[HfDataFilesField].value
    if data_files:
        identity["data_files"] = list(data_files)
    return identity


async def _tokenizer_identity(target: Target) -> dict[str, Any]:
    """A tokenizer of the repo by its files' digest, a folder by path, a package's or the hub's
    by name."""
    tokenizer = target[TokenizerField].value
    if tokenizer_address(tokenizer):
        files = await Get(TokenizerFiles, TokenizerFilesRequest(target.address, tokenizer))
        return {"kind": "local", "digest": files.digest.fingerprint}
    if tokenizer_directory(tokenizer):
        return {"kind": "local", "path": tokenizer}
    if tokenizer.startswith("package:"):
        return {"kind": "package", "name": tokenizer.split(":", 1)[1]}
    return {"kind": "hf", "id": tokenizer}


async def _resolve(target: Target, field_alias: str, values: tuple[str, ...]) -> list[Address]:
    resolved = await MultiGet(
        Get(Addresses, field_address_inputs(target.address, field_alias, [value]))
        for value in values
    )
    return [addresses[0] for addresses in resolved]


def _input_ref(target: Target, artifact: Artifact) -> dict[str, Any]:
    """How an artifact names one of its inputs: `name@version` and fingerprint."""
    if artifact.mutable and not is_mutable_version(target[ArtifactVersionField].value):
        raise InvalidFieldException(
            f"The `{target.alias}` {target.address} has the fixed version "
            f"{target[ArtifactVersionField].value!r} but its input {artifact.address} has the "
            f"mutable version {artifact.version!r}: give the input a calendar version, or make "
            f"this {target.alias}'s version `dev` too."
        )
    return {"input": artifact.ref, "fingerprint": artifact.fingerprint}


async def _checkpoint_identity(
    target: Target, caches: dict[Address, Artifact], parent: Optional[Artifact]
) -> tuple[dict[str, Any], tuple[Address, ...]]:
    mixture = target[DatasetsField].value
    dataset_addresses = await _resolve(target, "datasets", mixture.addresses)
    validation_addresses = await _resolve(target, "validation", target[ValidationField].value or ())
    by_key = dict(zip(mixture.addresses, dataset_addresses))

    def input_ref(address: Address) -> dict[str, Any]:
        return _input_ref(target, caches[address])

    def weighted(weights: Mapping[str, float]) -> list[dict[str, Any]]:
        entries = [{**input_ref(by_key[key]), "weight": weight} for key, weight in weights.items()]
        return sorted(entries, key=lambda d: d["input"])

    datasets = weighted(mixture.weights)
    validation = [input_ref(address) for address in validation_addresses]
    evals_identity = await _evals_identity(target, target[EvalsField].value)
    identity = {
        "kind": LmCheckpointTarget.alias,
        "format": IDENTITY_FORMAT,
        "model": target[ModelField].value.to_json(),
        "optimizer": target[OptimizerField].value.to_json(),
        "datasets": datasets,
        "validation": sorted(validation, key=lambda d: d["input"]),
        "batch_size": target[BatchSizeField].value,
        "seq_len": target[SeqLenField].value,
        "num_train_steps": target[NumTrainStepsField].value,
        "z_loss_weight": target[ZLossWeightField].value,
        "evals": evals_identity,
        "seed": target[SeedField].value,
        "compute_dtype": target[ComputeDtypeField].value,
    }
    init_from = target[InitFromField].value
    if init_from is not None:  # only when set: fingerprints of runs without it are unchanged
        identity["init_from"] = _model_identity(init_from, parent, training=True)
    loss_positions = target[LossPositionsField].value
    if loss_positions is not None:  # likewise
        identity["loss_positions"] = loss_positions
    data_order = target[DataOrderField].value
    if data_order is not None:  # likewise
        identity["data_order"] = data_order
    if mixture.stages:  # likewise
        identity["stages"] = [
            {"start_step": step, "datasets": weighted(weights)} for step, weights in mixture.stages
        ]
    parents = (parent.address,) if parent is not None else ()
    return identity, (*dataset_addresses, *validation_addresses, *parents)


async def _evals_identity(target: Target, evals: Optional[EvalSuite]) -> Optional[dict[str, Any]]:
    """An eval suite as identity: its tasks, and its local task files by content."""
    if not evals:
        return None
    evals_json: dict[str, Any] = evals.to_json()
    if evals.task_files:  # local task files count by content, not by address
        files = (await Get(
            ReferencedFiles, ReferencedFilesRequest(target.address, evals.task_files, "evals")
        )).sources
        evals_json["task_files"] = files.snapshot.digest.fingerprint
    return evals_json


def _once(evals: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """An evaluation's suite without `every`: it scores once, so the cadence changes nothing."""
    return None if evals is None else {k: v for k, v in evals.items() if k != "every"}


async def _eval_identity(
    target: Target, caches: dict[Address, Artifact], parent: Optional[Artifact]
) -> tuple[dict[str, Any], tuple[Address, ...]]:
    """An evaluation is its model (a run or export of the graph by fingerprint and step, or
    published weights), its suite, its validation caches and how their windows are cut."""
    validation = await _resolve(target, "validation", target[EvalValidationField].value or ())
    model = target[EvalModelField].value
    identity = {
        "kind": LmEvalRunTarget.alias,
        "format": IDENTITY_FORMAT,
        "model": _model_identity(model, parent, training=False),
        "evals": _once(await _evals_identity(target, target[EvalSuiteField].value)),
        "validation": sorted(
            (_input_ref(target, caches[a]) for a in validation), key=lambda d: d["input"]
        ),
        "seq_len": target[EvalSeqLenField].value,
        "batch_size": target[EvalBatchSizeField].value,
        "max_eval_batches": target[EvalBatchesField].value,
        "compute_dtype": target[EvalComputeDtypeField].value,
    }
    parents = (parent.address,) if parent is not None else ()
    return identity, (*validation, *parents)


def _model_identity(
    named: Union[HfModelSource, CheckpointInit], parent: Optional[Artifact], *, training: bool
) -> dict[str, Any]:
    """Weights named by a field: a run or export of the graph by its fingerprint, the step
    taken and (`training`) what else a run carries from it, or published weights as given."""
    if isinstance(named, CheckpointInit):
        assert parent is not None  # the graph resolved the address
        return parent_run(named, parent, training=training).to_json()
    return named.to_json()


def parent_run(init_from: CheckpointInit, parent: Artifact, *, training: bool) -> ParentRun:
    """The run `init_from` names, as the step spec and the identity carry it. A run training
    from an lm_checkpoint carries its optimizer state and continues its data stream unless told
    otherwise (as Marin's cooldowns do); an evaluation reads weights alone."""
    carries = training and parent.kind == LmCheckpointTarget.alias
    optimizer_state = init_from.optimizer_state
    return ParentRun(
        parent.kind, parent.name, parent.version, parent.fingerprint, step=init_from.step,
        optimizer_state=carries if optimizer_state is None else optimizer_state,
        data_continues=carries and not init_from.reset_data_loader_on_init,
    )  # fmt: skip


def _model_field(target: Target) -> type[Field]:
    """The field naming the model a checkpoint starts from, or an evaluation scores."""
    return EvalModelField if isinstance(target, LmEvalRunTarget) else InitFromField


async def _parent_address(target: Target) -> Optional[Address]:
    """The artifact a checkpoint's `init_from` (an evaluation's `model`) names by address, if
    it does."""
    field = _model_field(target)
    value = target[field].value
    if not isinstance(value, CheckpointInit):
        return None
    [address] = await _resolve(target, field.alias, (value.address,))
    return address


def _parents_first(
    targets: list[Target], parents: dict[Address, Optional[Address]]
) -> list[Target]:
    """Checkpoints and exports ordered so that every one comes after the one it reads (Pants
    refuses a dependency cycle before this runs)."""
    by_address = {t.address: t for t in targets}
    ordered: list[Target] = []
    placed: set[Address] = set()

    def place(target: Target) -> None:
        if target.address in placed:
            return
        parent = parents.get(target.address)
        if parent in by_address:
            place(by_address[parent])
        placed.add(target.address)
        ordered.append(target)

    for target in targets:
        place(target)
    return ordered


async def _hf_model_identity(
    target: Target, address: Address, checkpoints: dict[Address, Artifact]
) -> tuple[dict[str, Any], tuple[Address, ...]]:
    """An export is its checkpoint (by fingerprint) at one step, in one dtype."""
    if address not in checkpoints:
        raise InvalidFieldException(
            f"The `checkpoint` field in target {target.address} refers to {address}, which is "
            "not an `lm_checkpoint`."
        )
    identity = {
        "kind": HfModelTarget.alias,
        "format": IDENTITY_FORMAT,
        "checkpoint": _input_ref(target, checkpoints[address]),
        "step": target[ExportStepField].value,
        "dtype": target[ExportDtypeField].value,
    }
    return identity, (address,)


def _artifact(
    target: Target,
    identity: dict[str, Any],
    inputs: tuple[Address, ...],
    parent: Optional[Address] = None,
) -> Artifact:
    inline = target.has_field(CacheStorageField) and target[CacheStorageField].value == "inline"
    return Artifact(
        address=target.address,
        kind=target.alias,
        name=default_artifact_name(target),
        version=target[ArtifactVersionField].value,
        identity_json=canonical_json(identity),
        fingerprint=fingerprint(identity),
        inputs=inputs,
        in_store=not inline,
        parent=parent,
    )


@dataclass(frozen=True)
class ArtifactGraphRequest:
    addresses: Addresses


@rule(desc="Computing artifact fingerprints")
async def artifact_graph(request: ArtifactGraphRequest) -> ArtifactGraph:
    closure = await Get(TransitiveTargets, TransitiveTargetsRequest(request.addresses))
    targets = sorted(closure.closure, key=lambda t: t.address)
    for target in targets:
        check_target(target)
    refuse_shared_folders(targets, await Get(ArtifactFolders))
    by_address = {t.address: t for t in targets}
    caches = {}
    for cache in (t for t in targets if isinstance(t, TokenizedCacheTarget)):
        caches[cache.address] = _artifact(cache, await _cache_identity(cache), ())

    # Checkpoints and exports read one another (an export its checkpoint, a run the run or
    # export it starts from): each is fingerprinted after the one it reads.
    models: list[Target] = [
        t for t in targets if isinstance(t, (LmCheckpointTarget, HfModelTarget, LmEvalRunTarget))
    ]
    parents: dict[Address, Optional[Address]] = {}
    for target in models:
        if isinstance(target, HfModelTarget):
            value = (target[CheckpointField].value,)
            [parents[target.address]] = await _resolve(target, CheckpointField.alias, value)
        else:
            parents[target.address] = await _parent_address(target)
    built: dict[Address, Artifact] = {}
    for target in _parents_first(models, parents):
        parent = parents[target.address]
        if isinstance(target, HfModelTarget):
            assert parent is not None  # an export always names its checkpoint
            checkpoints = {a: x for a, x in built.items() if x.kind == LmCheckpointTarget.alias}
            identity, inputs = await _hf_model_identity(target, parent, checkpoints)
            built[target.address] = _artifact(target, identity, inputs)
            continue
        parent_artifact = _parent_artifact(target, parent, built, by_address)
        if isinstance(target, LmEvalRunTarget):
            identity, inputs = await _eval_identity(target, caches, parent_artifact)
        else:
            identity, inputs = await _checkpoint_identity(target, caches, parent_artifact)
        built[target.address] = _artifact(target, identity, inputs, parent)
    return ArtifactGraph([*caches.values(), *built.values()])


async def artifact_and_graph(address: Address) -> tuple[Artifact, ArtifactGraph]:
    """The artifact at `address` and the artifact graph of its closure (its inputs' artifacts)."""
    graph = await Get(ArtifactGraph, ArtifactGraphRequest(Addresses([address])))
    return graph.get(address), graph


@dataclass(frozen=True)
class ArtifactOrProblemRequest:
    address: Address


@dataclass(frozen=True)
class ArtifactOrProblem:
    """A target's artifact, or why its graph cannot be made (one line), for a goal that reads
    many targets and goes on past a bad one (`pants store`)."""

    artifact: Optional[Artifact]
    problem: Optional[str] = None


@rule(desc="Computing an artifact's fingerprint")
async def artifact_or_problem(request: ArtifactOrProblemRequest) -> ArtifactOrProblem:
    try:
        artifact, _ = await artifact_and_graph(request.address)
    except Exception as e:  # noqa: BLE001 - the caller reports it and goes on
        return ArtifactOrProblem(None, " ".join(engine_message(e).split()))
    return ArtifactOrProblem(artifact)


def engine_message(error: Exception) -> str:
    """The message of an error a rule raised, without the engine's traceback around it."""
    wrapped = getattr(error, "wrapped_exceptions", None)
    inner = wrapped[-1] if wrapped else error
    return str(inner).strip() or type(inner).__name__


async def target_and_graph(address: Address, origin: str) -> tuple[Target, ArtifactGraph]:
    """The artifact target at `address` and the artifact graph of its closure, fetched together
    (`origin`: who asks, for Pants' messages)."""
    wrapped, graph = await MultiGet(
        Get(WrappedTarget, WrappedTargetRequest(address, description_of_origin=origin)),
        Get(ArtifactGraph, ArtifactGraphRequest(Addresses([address]))),
    )
    return wrapped.target, graph


def _parent_artifact(
    target: Target,
    parent: Optional[Address],
    built: dict[Address, Artifact],
    targets: Mapping[Address, Target],
) -> Optional[Artifact]:
    """The artifact a checkpoint starts from (an evaluation scores): an lm_checkpoint or an
    hf_model of the graph, at a step it saves."""
    if parent is None:
        return None
    field = _model_field(target)
    if parent not in built or built[parent].kind == LmEvalRunTarget.alias:
        raise InvalidFieldException(
            f"The `{field.alias}` field in target {target.address} refers to {parent}, which is "
            "neither an `lm_checkpoint` nor an `hf_model`: name one of those (or published "
            "weights: `hf_model_source(...)`)."
        )
    artifact = built[parent]
    named = target[field].value
    assert isinstance(named, CheckpointInit)  # only an address has a parent
    takes_a_step = (
        named.step is not None or named.optimizer_state or named.reset_data_loader_on_init
    )
    if artifact.kind == HfModelTarget.alias and takes_a_step:
        raise InvalidFieldException(
            f"The `{field.alias}` field in target {target.address} gives a step, "
            f"optimizer_state or reset_data_loader_on_init for {parent}, an `hf_model` export "
            "(one step's weights): name its lm_checkpoint instead."
        )
    if named.step is not None and artifact.kind == LmCheckpointTarget.alias:
        _check_saved_step(target, field, targets[parent], named.step)
    if isinstance(target, LmEvalRunTarget):
        return artifact  # an evaluation reads the model as it is
    trained = built[artifact.inputs[0]] if artifact.kind == HfModelTarget.alias else artifact
    differing = weights_differences(target[ModelField].value.to_json(), trained.identity["model"])
    if differing:
        raise InvalidFieldException(
            f"The `init_from` field in target {target.address} names {parent}, whose weights "
            f"are not the architecture `model` declares ({'; '.join(differing)}): make "
            "`model=llama(...)` match the parent's."
        )
    continues = artifact.kind == LmCheckpointTarget.alias and not named.reset_data_loader_on_init
    if continues and target[DataOrderField].value == "levanter":
        raise InvalidFieldException(
            f"The `init_from` field in target {target.address}: a run continuing {parent}'s "
            "data stream reads Kiln's order, not `data_order=\"levanter\"`; start its data "
            "afresh with `from_checkpoint(..., reset_data_loader_on_init=True)`."
        )
    return artifact


def _check_saved_step(target: Target, field: type[Field], parent: Target, step: int) -> None:
    """`step` must be one the parent keeps: a multiple of its checkpoint_every, or its end."""
    every, end = parent[CheckpointEveryField].value, parent[NumTrainStepsField].value
    if step == end or (0 < step < end and step % every == 0):
        return
    saved = f"every {every} steps and its last, {end}" if every < end else f"its last, {end}"
    raise InvalidFieldException(
        f"The `{field.alias}` field in target {target.address} names step {step} of "
        f"{parent.address}, which it does not keep: it saves {saved} "
        "(`checkpoint_every` on it saves more)."
    )


def rules():
    return collect_rules()
