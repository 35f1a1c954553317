"""DEP_FAILED marks in the artifact store: written into the folders of artifacts whose input
failed in a `pants build`, cleared when a step builds again, by the runtime's
`python -m kiln.artifacts.dep_failed` (one function for every store)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from pants.engine.rules import collect_rules, rule

from kiln_contract.inventory import FolderOutcome
from kiln_pants.runtime import DEP_FAILED_MARKS
from kiln_pants.store_process import store_process

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DepFailedMarks:
    """Marks to write into the store's folders (`name/version`) and marks to clear, by the
    runtime's `python -m kiln.artifacts.dep_failed` (one function for every store)."""

    prefix: str
    marks: tuple[tuple[str, str], ...] = ()  # (folder, the reason beside its STATUS)
    clears: tuple[str, ...] = ()


@dataclass(frozen=True)
class DepFailedMarked:
    folders: tuple[str, ...]  # those marked: the others hold a built artifact or a run


@rule(desc="Updating DEP_FAILED marks in the artifact store")
async def write_dep_failed_marks(request: DepFailedMarks) -> DepFailedMarked:
    argv = [request.prefix]
    for folder in request.clears:
        argv += ["--clear", folder]
    for folder, reason in request.marks:
        argv += ["--mark", folder, reason]
    # Said as it is: a step about to build only clears an earlier build's mark, if there is one.
    doing = "Writing DEP_FAILED marks into" if request.marks else "Clearing any DEP_FAILED mark in"
    description = f"{doing} {request.prefix}"
    result = await store_process(DEP_FAILED_MARKS, tuple(argv), description)
    if result.exit_code != 0:  # the marks say more; the build's outcome stands without them
        why = result.stderr.decode(errors="replace").strip().splitlines()
        logger.warning(
            f"kiln: DEP_FAILED marks not written: {why[-1] if why else result.exit_code}"
        )
        return DepFailedMarked(())
    marked = FolderOutcome.read_lines(result.stdout.decode())
    return DepFailedMarked(tuple(outcome.folder for outcome in marked if outcome.done))


def rules():
    return collect_rules()
