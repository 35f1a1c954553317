"""Kiln's Pants backend: artifact target types, BUILD-file helpers and the rules that build them."""

from pants.build_graph.build_file_aliases import BuildFileAliases

from kiln_pants import (
    artifact_folders,
    artifact_graph,
    artifact_store,
    build,
    cache_layout,
    cache_spec,
    compare,
    dep_failed_marks,
    dependency_inference,
    eval_rules,
    fit_check,
    hf_model_rules,
    housekeeping,
    hub_settings,
    mixture_budget,
    package,
    plan,
    runtime,
    shard_plan,
    signals,
    store_inventory,
    tokenize_rules,
    train_rules,
    training_cost,
)
from kiln_pants.eval_targets import LmEvalRunTarget
from kiln_pants.field_values import BUILD_FILE_OBJECTS
from kiln_pants.hf_model_targets import HfModelTarget
from kiln_pants.sweeps import LmSweepMacro
from kiln_pants.target_types import ARTIFACT_TARGET_TYPES


def build_file_aliases() -> BuildFileAliases:
    return BuildFileAliases(
        objects=BUILD_FILE_OBJECTS, context_aware_object_factories={"lm_sweep": LmSweepMacro}
    )


def target_types():
    return [*ARTIFACT_TARGET_TYPES, HfModelTarget, LmEvalRunTarget]


def rules():
    # Loaded into the Pants process that runs the rules: from here on, SIGTERM stops a run.
    signals.forward_sigterm_as_interrupt()
    return [
        *artifact_folders.rules(),
        *artifact_graph.rules(),
        *artifact_store.rules(),
        *build.rules(),
        *cache_layout.rules(),
        *cache_spec.rules(),
        *compare.rules(),
        *dep_failed_marks.rules(),
        *dependency_inference.rules(),
        *eval_rules.rules(),
        *fit_check.rules(),
        *hf_model_rules.rules(),
        *housekeeping.rules(),
        *hub_settings.rules(),
        *package.rules(),
        *mixture_budget.rules(),
        *plan.rules(),
        *runtime.rules(),
        *shard_plan.rules(),
        *store_inventory.rules(),
        *tokenize_rules.rules(),
        *train_rules.rules(),
        *training_cost.rules(),
    ]
