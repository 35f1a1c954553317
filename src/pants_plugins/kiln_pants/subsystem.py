"""The `[kiln]` options."""

from __future__ import annotations

import os

from pants.option.option_types import StrOption
from pants.option.subsystem import Subsystem


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

    def prefix_path(self, buildroot: str) -> str:
        if "://" in self.prefix:
            raise ValueError(
                f"[kiln] prefix = {self.prefix!r}: object-store URLs are not supported yet; mount "
                "the bucket and give its local path."
            )
        return os.path.normpath(os.path.join(buildroot, self.prefix))
