"""Artifact inputs are real Pants dependencies.

An `lm_checkpoint`'s `datasets` and `validation` addresses and the run its `init_from` names, an
`lm_eval_run`'s model and validation caches, an `hf_model`'s checkpoint and a
`tokenized_cache`'s tokenizer target are inferred as dependencies, so `pants dependencies`,
`dependents` and `peek` answer graph questions ("which checkpoints depend on this tokenizer?",
"which cooldowns start from this run?"). Inference is also where a reference to the wrong kind
of target is caught.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Optional

from pants.engine.addresses import Address, Addresses, UnparsedAddressInputs
from pants.engine.rules import Get, collect_rules, rule
from pants.engine.target import (
    FieldSet,
    InferDependenciesRequest,
    InferredDependencies,
    InvalidFieldException,
    Target,
    UnexpandedTargets,
    WrappedTarget,
    WrappedTargetRequest,
)
from pants.engine.unions import UnionRule

from kiln_pants.eval_targets import (
    EvalModelField,
    EvalSuiteField,
    EvalValidationField,
    LmEvalRunDependencies,
)
from kiln_pants.field_problems import check_target
from kiln_pants.field_values import CheckpointInit, EvalSuite
from kiln_pants.hf_model_targets import CheckpointField, HfModelDependencies
from kiln_pants.target_types import (
    DatasetsField,
    EvalsField,
    InitFromField,
    LmCheckpointDependencies,
    LmCheckpointTarget,
    TokenizedCacheDependencies,
    TokenizedCacheTarget,
    TokenizerField,
    ValidationField,
    tokenizer_address,
)


def field_address_inputs(
    owner: Address, alias: str, values: Iterable[str]
) -> UnparsedAddressInputs:
    """The addresses a field of `owner` gives, relative to it; a bad one is reported as the
    field's."""
    return UnparsedAddressInputs(
        values, owning_address=owner, description_of_origin=f"the `{alias}` field of {owner}"
    )


async def addresses_of_kind(
    owner: Address, alias: str, values: Iterable[str], kind: type[Target], kind_phrase: str
) -> Addresses:
    """The addresses a field of `owner` gives, each of which must be a `kind` target
    (`kind_phrase`: "a `tokenized_cache`")."""
    addresses = await Get(Addresses, field_address_inputs(owner, alias, values))
    # Unexpanded: a `files` generator must be reported as itself, not as its first file.
    for target in await Get(UnexpandedTargets, Addresses, addresses):
        if not isinstance(target, kind):
            raise InvalidFieldException(
                f"The `{alias}` field in target {owner} refers to "
                f"{target.address}, a `{target.alias}` target; it must be {kind_phrase}."
            )
    return addresses


async def _inferred(
    owner: Address,
    *,
    caches: tuple[tuple[str, tuple[str, ...]], ...],
    evals: Optional[EvalSuite],
    model: tuple[str, Any],
) -> InferredDependencies:
    """The caches (each must be a `tokenized_cache`), the suite's local task files and the run a
    model field names by address, as dependencies of `owner`."""
    addresses: list[Address] = []
    for alias, values in caches:
        addresses.extend(
            await addresses_of_kind(
                owner, alias, values, TokenizedCacheTarget, "a `tokenized_cache`"
            )
        )
    named = [(EvalsField.alias, evals.task_files)] if evals and evals.task_files else []
    model_alias, model_value = model
    if isinstance(model_value, CheckpointInit):  # the run it starts from or scores: built first
        named.append((model_alias, model_value.address))
    for alias, address in named:
        addresses.extend(await Get(Addresses, field_address_inputs(owner, alias, [address])))
    return InferredDependencies(addresses)


async def _check_target(address: Address) -> None:
    """Raises what is wrong with the target whose inputs are inferred (its fields are read)."""
    wrapped = await Get(
        WrappedTarget, WrappedTargetRequest(address, description_of_origin="<infallible>")
    )
    check_target(wrapped.target)


@dataclass(frozen=True)
class LmCheckpointInputsFieldSet(FieldSet):
    required_fields = (
        DatasetsField, ValidationField, EvalsField, InitFromField, LmCheckpointDependencies
    )

    datasets: DatasetsField
    validation: ValidationField
    evals: EvalsField
    init_from: InitFromField
    dependencies: LmCheckpointDependencies


class InferLmCheckpointInputs(InferDependenciesRequest):
    infer_from = LmCheckpointInputsFieldSet


@rule(desc="Inferring the inputs of an lm_checkpoint")
async def infer_lm_checkpoint_inputs(request: InferLmCheckpointInputs) -> InferredDependencies:
    field_set = request.field_set
    await _check_target(field_set.address)
    return await _inferred(
        field_set.address,
        caches=((DatasetsField.alias, field_set.datasets.value.addresses),
                (ValidationField.alias, tuple(field_set.validation.value or ()))),
        evals=field_set.evals.value,
        model=(InitFromField.alias, field_set.init_from.value),
    )  # fmt: skip


@dataclass(frozen=True)
class LmEvalRunInputsFieldSet(FieldSet):
    required_fields = (EvalModelField, EvalSuiteField, EvalValidationField, LmEvalRunDependencies)

    model: EvalModelField
    evals: EvalSuiteField
    validation: EvalValidationField
    dependencies: LmEvalRunDependencies


class InferLmEvalRunInputs(InferDependenciesRequest):
    infer_from = LmEvalRunInputsFieldSet


@rule(desc="Inferring the inputs of an lm_eval_run")
async def infer_lm_eval_run_inputs(request: InferLmEvalRunInputs) -> InferredDependencies:
    field_set = request.field_set
    await _check_target(field_set.address)
    return await _inferred(
        field_set.address,
        caches=((EvalValidationField.alias, tuple(field_set.validation.value or ())),),
        evals=field_set.evals.value,
        model=(EvalModelField.alias, field_set.model.value),
    )


@dataclass(frozen=True)
class TokenizerFieldSet(FieldSet):
    required_fields = (TokenizerField, TokenizedCacheDependencies)

    tokenizer: TokenizerField
    dependencies: TokenizedCacheDependencies


class InferTokenizerTarget(InferDependenciesRequest):
    infer_from = TokenizerFieldSet


@rule(desc="Inferring the tokenizer target of a tokenized_cache")
async def infer_tokenizer_target(request: InferTokenizerTarget) -> InferredDependencies:
    await _check_target(request.field_set.address)
    address = tokenizer_address(request.field_set.tokenizer.value)
    if address is None:
        return InferredDependencies([])
    inputs = field_address_inputs(request.field_set.address, TokenizerField.alias, [address])
    return InferredDependencies(await Get(Addresses, inputs))


@dataclass(frozen=True)
class HfModelCheckpointFieldSet(FieldSet):
    required_fields = (CheckpointField, HfModelDependencies)

    checkpoint: CheckpointField
    dependencies: HfModelDependencies


class InferHfModelCheckpoint(InferDependenciesRequest):
    infer_from = HfModelCheckpointFieldSet


@rule(desc="Inferring the checkpoint of an hf_model")
async def infer_hf_model_checkpoint(request: InferHfModelCheckpoint) -> InferredDependencies:
    field_set = request.field_set
    await _check_target(field_set.address)
    addresses = await addresses_of_kind(
        field_set.address, CheckpointField.alias, [field_set.checkpoint.value],
        LmCheckpointTarget, "an `lm_checkpoint`",
    )  # fmt: skip
    return InferredDependencies(addresses)


def rules():
    return [
        *collect_rules(),
        UnionRule(InferDependenciesRequest, InferLmCheckpointInputs),
        UnionRule(InferDependenciesRequest, InferLmEvalRunInputs),
        UnionRule(InferDependenciesRequest, InferTokenizerTarget),
        UnionRule(InferDependenciesRequest, InferHfModelCheckpoint),
    ]
