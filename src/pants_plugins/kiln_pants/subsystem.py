"""The `[kiln]` options."""

from __future__ import annotations

import os
import re
from typing import Optional

from pants.engine.console import Console
from pants.option.option_types import DictOption, StrOption
from pants.option.subsystem import Subsystem

from kiln_contract.location import BUCKET_SCHEMES, in_bucket
from kiln_contract.vocabulary import WANDB_MODES


class KilnSubsystem(Subsystem):
    options_scope = "kiln"
    help = "Kiln: language-model artifacts (tokenized caches, checkpoints) as Pants targets."

    prefix = StrOption(
        default="artifacts",
        help=(
            "The artifact store: artifacts live at `{prefix}/{artifact_name}/{version}`. A path "
            "relative to the build root, or absolute (e.g. a shared filesystem so teammates and "
            "runs reuse each other's artifacts), or a bucket: `s3://BUCKET/PATH` (AWS or an "
            "S3-compatible store through AWS_ENDPOINT_URL) or `gs://BUCKET/PATH`. One run "
            "overrides it with `-- --prefix LOCATION` (docs/artifacts.md)."
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

    price_per_device_hour = DictOption[float](
        help=(
            "What a device-hour costs, by device type (a `gpu(...)`/`tpu(...)` type, or `cpu`), "
            "e.g. `{\"H100\": 2.5, \"cpu\": 0.05}`: `pants plan` turns each run's device-hours "
            "into money with it (docs/sweeps.md)."
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

    def prefix_location(self, buildroot: str) -> str:
        """The store: an absolute local path, or a bucket URL (its shape checked)."""
        if not in_bucket(self.prefix):
            refuse_a_mistyped_url(self.prefix)
            return os.path.normpath(os.path.join(buildroot, self.prefix))
        return bucket_url(self.prefix)

    def prefix_or_report(self, console: Console, buildroot: str) -> Optional[str]:
        """The store (prefix_location) for a goal; None after printing the one line saying what
        is wrong with `[kiln] prefix`, not the engine's traceback around it."""
        try:
            return self.prefix_location(buildroot)
        except ValueError as e:
            console.print_stderr(f"kiln: error: {e}")
            return None


_BUCKET_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{1,61}[a-z0-9]$")
_PATH_PART = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._=-]*$")


_ONE_SLASH_URL = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*):/+(?P<rest>.*)$")


def refuse_a_mistyped_url(path: str) -> None:
    """A local prefix that is a URL with a slash missing (`s3:/bucket/x`) would silently become a
    folder `s3:` in the repository: ValueError instead, with the URL it means."""
    mistyped = _ONE_SLASH_URL.match(path)
    if mistyped and "://" not in path:
        raise ValueError(
            f"[kiln] prefix = {path!r}: a URL needs '://' after its scheme; did you mean "
            f"{mistyped['scheme']}://{mistyped['rest']}?"
        )


def bucket_url(url: str) -> str:
    """`url` normalized (no trailing `/`) if it is `s3://BUCKET/PATH` or `gs://BUCKET/PATH` with
    a valid bucket name and plain path parts; ValueError saying what is wrong otherwise."""
    scheme, _, rest = url.partition("://")
    bucket, _, path = rest.strip("/").partition("/")
    where = f"[kiln] prefix = {url!r}"
    if scheme not in BUCKET_SCHEMES:
        raise ValueError(
            f"{where}: Kiln stores artifacts in s3://BUCKET/PATH, gs://BUCKET/PATH or a local "
            "directory; for another store, mount it and give its mount point."
        )
    if not _BUCKET_NAME.match(bucket):
        raise ValueError(
            f"{where}: {bucket!r} is not a valid {BUCKET_SCHEMES[scheme]} bucket name (3 to 63 "
            "lowercase letters, digits, '.', '_' or '-'); write it as "
            f"{scheme}://BUCKET/PATH"
        )
    bad = [part for part in path.split("/") if path and not _PATH_PART.match(part)]
    if bad:
        raise ValueError(
            f"{where}: the path part {bad[0]!r} is not allowed; use letters, digits, '_', '.', "
            "'=' and '-', not starting with '.' or '-'"
        )
    return f"{scheme}://{bucket}/{path}" if path else f"{scheme}://{bucket}"
