"""The `lm_eval_run` target type: a model scored on an eval suite and validation caches, as an
artifact of its own (docs/evals.md). Its identity is the model's (a run of the graph at a step,
an export, or published weights), the suite's and the validation caches' fingerprints, and how
the windows are cut (`artifact_graph.py`); `eval_rules.py` builds it.
"""

from __future__ import annotations

from typing import Any, Optional, Union

from pants.engine.addresses import Address
from pants.engine.target import (
    COMMON_TARGET_FIELDS,
    Dependencies,
    Field,
    InvalidFieldException,
    Target,
)

from kiln_contract.train import HfModelSource
from kiln_pants.field_problems import holds_field_problems
from kiln_pants.field_values import CheckpointInit, is_whole_number
from kiln_pants.target_types import (
    ArtifactNameField,
    ArtifactVersionField,
    BatchSizeField,
    ComputeDtypeField,
    EvalsField,
    FormCheckedField,
    SeqLenField,
    ValidationField,
    check_default_artifact_name,
    weights_named,
)


class EvalArtifactNameField(ArtifactNameField):
    help = (
        "The evaluation's name in the artifact store, e.g. `evals/quickstart`; it may contain "
        "`/`. Defaults to `evals/<target name>`."
    )


class EvalModelField(Field):
    alias = "model"
    required = True
    value: Union[HfModelSource, CheckpointInit]
    help = (
        "The model scored: a run of the graph by address, `model=':quickstart'` (its final "
        "checkpoint) or `from_checkpoint(':quickstart', step=200)`; an `hf_model` export's "
        "address; or published weights, `hf_model_source('org/model', revision='COMMIT')` or "
        "a folder's absolute path. A run or export is a dependency, built first."
    )

    @classmethod
    def compute_value(
        cls, raw_value: Optional[Any], address: Address
    ) -> Union[HfModelSource, CheckpointInit]:
        value = weights_named(cls.alias, address, super().compute_value(raw_value, address))
        if isinstance(value, CheckpointInit) and (
            value.optimizer_state is not None or value.reset_data_loader_on_init
        ):
            raise InvalidFieldException(
                f"The `model` field in target {address}: an evaluation reads weights only; "
                "remove `optimizer_state` and `reset_data_loader_on_init`."
            )
        return value


class EvalSeqLenField(SeqLenField):
    help = "The length of the validation windows; at most the model's `max_seq_len`."


class EvalBatchSizeField(BatchSizeField):
    help = "Validation windows per batch (a run reports what it scores with its own batch size)."


class EvalBatchesField(FormCheckedField):
    alias = "max_eval_batches"
    default = None
    expected = "a whole number > 0, or 'all'"
    value: Optional[int]  # None: each whole cache ('all', as lm_checkpoint's field says it)
    help = (
        "Validation batches per cache: a number, or `'all'` (the default) for each whole cache. "
        "Part of the identity: it decides which windows are scored."
    )

    @classmethod
    def accepts(cls, value: Any) -> bool:
        return value is None or value == "all" or is_whole_number(value, minimum=1)

    @classmethod
    def compute_value(cls, raw_value: Optional[Any], address: Address) -> Optional[int]:
        value = super().compute_value(raw_value, address)
        return None if value == "all" else value  # one identity for the whole cache


class EvalComputeDtypeField(ComputeDtypeField):
    default = "float32"


class EvalValidationField(ValidationField):
    required = False
    default = ()
    help = "The `tokenized_cache` addresses whose loss and bits-per-byte are scored."


class EvalSuiteField(EvalsField):
    required = False
    default = None
    help = "The lm-eval suite scored, as `eval_suite([...], every=1)`; None for validation only."


class LmEvalRunDependencies(Dependencies):
    pass


@holds_field_problems
class LmEvalRunTarget(Target):
    alias = "lm_eval_run"
    core_fields = (
        *COMMON_TARGET_FIELDS,
        EvalArtifactNameField,
        ArtifactVersionField,
        EvalModelField,
        EvalSuiteField,
        EvalValidationField,
        EvalSeqLenField,
        EvalBatchSizeField,
        EvalBatchesField,
        EvalComputeDtypeField,
        LmEvalRunDependencies,
    )
    help = (
        "A model scored on an eval suite and validation caches (Marin's eval steps): a run of the "
        "graph, an export or published weights, with the code and metric names training reports "
        "(`lm_eval/TASK/acc`, `eval/NAME/loss`, `eval/NAME/bpb`). `pants package` (or `pants "
        "build`) writes `results.json` into the artifact store at `{prefix}/{artifact_name}/"
        "{version}`; `pants compare` puts it beside runs."
    )

    def check_fields(self) -> None:
        """Cross-field checks, run where Kiln reads the target (kiln_pants.field_problems)."""
        if self[EvalSuiteField].value is None and not self[EvalValidationField].value:
            raise InvalidFieldException(
                f"The `lm_eval_run` target {self.address} scores nothing: give it `evals`, "
                "`validation` or both."
            )
        check_default_artifact_name(self)
