"""The `[kiln]` options."""

from __future__ import annotations

import os
import re

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

    def prefix_location(self, buildroot: str) -> str:
        """The store: an absolute local path, or a bucket URL (its shape checked)."""
        if "://" not in self.prefix:
            return os.path.normpath(os.path.join(buildroot, self.prefix))
        return bucket_url(self.prefix)

    def prefix_path(self, buildroot: str, *, needed_by: str) -> str:
        """The store's local path; an error naming `needed_by` when the prefix is a bucket."""
        location = self.prefix_location(buildroot)
        if "://" in location:
            raise ValueError(
                f"[kiln] prefix = {self.prefix!r}: {needed_by} needs a local artifact store "
                "(a directory, or a bucket mounted as one); give its path as the prefix, or "
                "`--kiln-prefix=PATH` for this command."
            )
        return location


_BUCKET_SCHEMES = {"s3": "S3", "gs": "Google Cloud Storage"}
_BUCKET_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{1,61}[a-z0-9]$")
_PATH_PART = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._=-]*$")


def bucket_url(url: str) -> str:
    """`url` normalized (no trailing `/`) if it is `s3://BUCKET/PATH` or `gs://BUCKET/PATH` with
    a valid bucket name and plain path parts; ValueError saying what is wrong otherwise."""
    scheme, _, rest = url.partition("://")
    bucket, _, path = rest.strip("/").partition("/")
    where = f"[kiln] prefix = {url!r}"
    if scheme not in _BUCKET_SCHEMES:
        raise ValueError(
            f"{where}: Kiln stores artifacts in s3://BUCKET/PATH, gs://BUCKET/PATH or a local "
            "directory; for another store, mount it and give its mount point."
        )
    if not _BUCKET_NAME.match(bucket):
        raise ValueError(
            f"{where}: {bucket!r} is not a valid {_BUCKET_SCHEMES[scheme]} bucket name (3 to 63 "
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
