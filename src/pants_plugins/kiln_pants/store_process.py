"""Runtime processes that read or write the artifact store: each with the store clients'
credentials and endpoints from the caller's environment, never kept beyond its session (the
store changes behind Pants' back), failing in one line that names the store."""

from __future__ import annotations

from pants.engine.env_vars import EnvironmentVars, EnvironmentVarsRequest
from pants.engine.fs import EMPTY_DIGEST
from pants.engine.process import FallibleProcessResult, Process, ProcessCacheScope
from pants.engine.rules import Get, MultiGet
from pants.util.frozendict import FrozenDict

from kiln_pants.runtime import EntryPoint, KilnProcess, Runtime, RuntimeProcess, RuntimeRequest

# Where bucket clients find credentials and endpoints (docs/artifacts.md, "Buckets"); HOME for
# ~/.aws and gcloud's application-default login. Only PER_SESSION processes get them.
STORE_ENVIRONMENT = (
    "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
    "AWS_REGION", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL", "AWS_CONFIG_FILE",
    "AWS_SHARED_CREDENTIALS_FILE", "AWS_EC2_METADATA_DISABLED", "GOOGLE_APPLICATION_CREDENTIALS",
    "CLOUDSDK_CONFIG", "STORAGE_EMULATOR_HOST", "TENSORSTORE_GCS_HTTP_URL", "HOME",
)  # fmt: skip


async def store_process(
    entry: EntryPoint, argv: tuple[str, ...], description: str
) -> FallibleProcessResult:
    """A runtime process that reads or writes the artifact store, with the store clients'
    credentials from the caller's environment; never kept beyond its session (the store
    changes behind Pants' back)."""
    runtime, environment = await MultiGet(
        Get(Runtime, RuntimeRequest(entry)),
        Get(EnvironmentVars, EnvironmentVarsRequest(STORE_ENVIRONMENT)),
    )
    process = (await Get(
        KilnProcess,
        RuntimeProcess(
            runtime,
            argv=argv,
            description=description,
            input_digest=EMPTY_DIGEST,
            output_directories=(),
            cache_scope=ProcessCacheScope.PER_SESSION,
            env=FrozenDict(environment),
        ),
    )).process
    return await Get(FallibleProcessResult, Process, process)


def process_failure(result: FallibleProcessResult) -> str:
    """A failed store process's one line (it names the store and what to check)."""
    lines = result.stderr.decode(errors="replace").strip().splitlines()
    return lines[-1].removeprefix("error: ") if lines else f"exit {result.exit_code}"
