"""The `hf_model` target type: an `lm_checkpoint` exported as a Hugging Face `transformers` Llama
folder (docs/interop.md). Its identity is the checkpoint's fingerprint, the step and the dtype
(`artifact_graph.py`); `hf_model_rules.py` builds it.
"""

from __future__ import annotations

from typing import Any, Union

from pants.engine.target import (
    COMMON_TARGET_FIELDS,
    Dependencies,
    StringField,
    Target,
)

from kiln_pants.field_problems import holds_field_problems
from kiln_pants.field_values import is_whole_number
from kiln_pants.target_types import (
    ArtifactNameField,
    ArtifactVersionField,
    FormCheckedField,
    check_default_artifact_name,
)

EXPORT_DTYPES = ("float32", "bfloat16")


class HfModelArtifactNameField(ArtifactNameField):
    help = (
        "The export's name in the artifact store, e.g. `hf/quickstart`; it may contain `/`. "
        "Defaults to `hf/<target name>`."
    )


class CheckpointField(FormCheckedField, StringField):
    value: str
    alias = "checkpoint"
    required = True
    expected = "the address of an `lm_checkpoint` target (`:name` or `//path:name`)"
    help = (
        "The address of the `lm_checkpoint` to export, e.g. `:quickstart`. It must be built in the "
        "artifact store (`pants run` it first)."
    )

    @classmethod
    def accepts(cls, value: str) -> bool:
        return value.startswith(("//", ":")) or ":" in value


class ExportStepField(FormCheckedField):
    alias = "step"
    default = "last"
    expected = "`last` or a step number >= 0"
    help = (
        "Which of the checkpoint's saved steps to export: `last` (the newest complete one, the "
        "final step of a finished run) or a step number."
    )
    value: Union[int, str]

    @classmethod
    def accepts(cls, value: Any) -> bool:
        return value == "last" or is_whole_number(value)


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


@holds_field_problems
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

    def check_fields(self) -> None:
        """Cross-field checks, run where Kiln reads the target (kiln_pants.field_problems)."""
        check_default_artifact_name(self)
