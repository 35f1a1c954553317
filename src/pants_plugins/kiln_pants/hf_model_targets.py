"""The `hf_model` target type: an `lm_checkpoint` exported as a Hugging Face `transformers` Llama
folder (docs/interop.md). Its identity is the checkpoint's fingerprint, the step and the dtype
(`artifact_graph.py`); `hf_model_rules.py` builds it.
"""

from __future__ import annotations

from typing import Any, Optional, Union

from pants.engine.addresses import Address
from pants.engine.target import (
    COMMON_TARGET_FIELDS,
    Dependencies,
    Field,
    InvalidFieldException,
    StringField,
    Target,
)

from kiln_pants.field_values import is_whole_number
from kiln_pants.target_types import (
    ArtifactNameField,
    ArtifactVersionField,
    check_default_artifact_name,
)

EXPORT_DTYPES = ("float32", "bfloat16")


class HfModelArtifactNameField(ArtifactNameField):
    help = (
        "The export's name in the artifact store, e.g. `hf/quickstart`; it may contain `/`. "
        "Defaults to `hf/<target name>`."
    )


class CheckpointField(StringField):
    value: str
    alias = "checkpoint"
    required = True
    help = (
        "The address of the `lm_checkpoint` to export, e.g. `:quickstart`. It must be built in the "
        "artifact store (`pants run` it first)."
    )

    @classmethod
    def compute_value(cls, raw_value: Optional[str], address: Address) -> str:
        value = super().compute_value(raw_value, address)
        assert value is not None
        if not value.startswith(("//", ":")) and ":" not in value:
            raise InvalidFieldException(
                f"The `checkpoint` field in target {address} must be the address of an "
                f"`lm_checkpoint` target (`:name` or `//path:name`); got {value!r}."
            )
        return value


class ExportStepField(Field):
    alias = "step"
    default = "last"
    help = (
        "Which of the checkpoint's saved steps to export: `last` (the newest complete one, the "
        "final step of a finished run) or a step number."
    )
    value: Union[int, str]

    @classmethod
    def compute_value(cls, raw_value: Optional[Any], address: Address) -> Union[int, str]:
        value = super().compute_value(raw_value, address)
        if value == "last" or is_whole_number(value):
            return value
        raise InvalidFieldException(
            f"The `step` field in target {address} must be `last` or a step number >= 0; "
            f"got {value!r}."
        )


class ExportDtypeField(StringField):
    value: str
    alias = "dtype"
    default = "bfloat16"
    valid_choices = EXPORT_DTYPES
    help = (
        "The dtype of the exported weights: `bfloat16` rounds each float32 parameter once (to "
        "nearest even); `float32` keeps them exactly."
    )


class HfModelDependencies(Dependencies):
    pass


class HfModelTarget(Target):
    alias = "hf_model"
    core_fields = (
        *COMMON_TARGET_FIELDS,
        HfModelArtifactNameField,
        ArtifactVersionField,
        CheckpointField,
        ExportStepField,
        ExportDtypeField,
        HfModelDependencies,
    )
    help = (
        "An `lm_checkpoint` as a Hugging Face `transformers` Llama folder (config.json, "
        "safetensors, the tokenizer), which `AutoModelForCausalLM.from_pretrained` and vLLM load "
        "as it is. `pants package` writes it into the artifact store at "
        "`{prefix}/{artifact_name}/{version}`."
    )

    def validate(self) -> None:
        check_default_artifact_name(self)
