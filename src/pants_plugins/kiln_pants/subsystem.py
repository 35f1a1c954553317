"""The `[kiln]` options."""

from __future__ import annotations

import os

from pants.option.option_types import StrOption
from pants.option.subsystem import Subsystem

from kiln_contract.vocabulary import WANDB_MODES


class KilnSubsystem(Subsystem):
    options_scope = "kiln"
    help = "Kiln: language-model artifacts (tokenized caches, checkpoints) as Pants targets."

    prefix = StrOption(
        default="artifacts",
        help=(
            "The artifact store: artifacts live at `{prefix}/{artifact_name}/{version}`. A path "
            "relative to the build root, or absolute (e.g. a shared filesystem so teammates and "
            "runs reuse each other's artifacts). Object-store URLs (gs://, s3://) are not "
            "supported yet: mount the bucket (gcsfuse, s3fs) and give its path."
        ),
    )

    cluster = StrOption(
        default="",
        help=(
            "Where `pants run` trains: empty for this machine, `ray://HOST:PORT` for a Ray "
            "cluster (Ray Client), or `auto` for the cluster in $RAY_ADDRESS. One run overrides "
            "it with `-- --cluster ADDRESS` or `-- --cluster local` (docs/clusters.md)."
        ),
    )

    wandb_project = StrOption(
        default=None,
        help=(
            "The W&B project of runs whose target's `wandb` names none. Unset: `$WANDB_PROJECT` "
            "when the run starts, else `kiln` (docs/training.md, \"W&B\")."
        ),
    )

    wandb_entity = StrOption(
        default=None,
        help=(
            "The W&B entity (team or user) of runs whose target's `wandb` names none. Unset: "
            "`$WANDB_ENTITY`, else W&B's default entity."
        ),
    )

    wandb_mode = StrOption(
        default=None,
        help=(
            "The W&B mode of runs whose target's `wandb` names none: `online`, `offline` (the "
            "run is written under the artifact; `wandb sync` uploads it) or `disabled`. Unset: "
            "`$WANDB_MODE`, else `offline`."
        ),
    )

    def wandb_settings(self) -> dict[str, str]:
        """The `[kiln] wandb_*` options that are set, checked: what a target's `wandb` falls
        back to."""
        if self.wandb_mode is not None and self.wandb_mode not in WANDB_MODES:
            raise ValueError(
                f"[kiln] wandb_mode = {self.wandb_mode!r}: expected one of {', '.join(WANDB_MODES)}"
            )
        options = {"project": self.wandb_project, "entity": self.wandb_entity,
                   "mode": self.wandb_mode}  # fmt: skip
        return {key: value for key, value in options.items() if value}

    def prefix_path(self, buildroot: str) -> str:
        if "://" in self.prefix:
            raise ValueError(
                f"[kiln] prefix = {self.prefix!r}: object-store URLs are not supported yet; mount "
                "the bucket and give its local path."
            )
        return os.path.normpath(os.path.join(buildroot, self.prefix))
