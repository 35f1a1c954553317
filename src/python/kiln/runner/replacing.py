"""`--force`: the built artifact is set aside while the rebuild trains, and deleted once the
rebuild succeeds (kiln.artifacts.replacement: the states a kill can leave, in any store)."""

from __future__ import annotations

from kiln.artifacts import replacement
from kiln.artifacts.folder import ArtifactFolder
from kiln.artifacts.storage_errors import StorageError, as_storage_error
from kiln.runner.errors import StepError
from kiln_contract.step import StepSpec


def is_replacing(folder: ArtifactFolder) -> bool:
    return replacement.is_replacing(folder.store, folder.key)


def begin(step: StepSpec, folder: ArtifactFolder, *, force: bool) -> None:
    """Under the lease. Forced: sets the built artifact aside (or goes on with a stopped forced
    rebuild). Not forced, with a forced rebuild under way: says that this run goes on with it."""
    store, key = folder.store, folder.key
    try:
        if force:
            done = replacement.set_aside(store, key, step.name, step.version, step.fingerprint)
            print(f"kiln: --force: {done}", flush=True)
        elif replacement.is_replacing(store, key) and not folder.is_built():
            said = replacement.resume(store, key)
            aside = store.location(replacement.replaced_key(key))
            print(
                f"kiln: going on with the forced rebuild of {step.ref}; the replaced artifact "
                f"stays at {aside} until it succeeds",
                flush=True,
            )
            if said:
                print(f"kiln: {said}", flush=True)
    except replacement.NotThisArtifact as e:
        raise StepError(str(e)) from None
    except OSError as e:
        raise as_storage_error(e, folder.location()) or e from None


def finish(step: StepSpec, folder: ArtifactFolder) -> None:
    """Once the rebuild has STATUS SUCCESS: deletes the artifact it replaced and names the built
    artifacts in the store that were built from it (they now point at an older input)."""
    try:
        finished = replacement.finish(folder.store, folder.key)
        if finished is None:
            return
        print(f"kiln: deleted the replaced {step.ref} ({finished.replaced})", flush=True)
        dependents = replacement.built_dependents(folder.store, step.ref)
    except (OSError, StorageError) as e:
        raise as_storage_error(e, folder.location()) or e from None
    if dependents:
        print(_dependents_note(step, dependents), flush=True)


def _dependents_note(step: StepSpec, dependents: list[replacement.Dependent]) -> str:
    lines = [
        f"kiln: note: {len(dependents)} built artifact(s) in the store were built from the "
        f"replaced {step.ref} and now point at an older input:"
    ]
    for dependent in dependents:
        if dependent.kind == "lm_checkpoint":
            how = "rebuild it: `pants run` its target with `-- --force`"
        else:
            how = f"delete {dependent.folder} and build its target again"
        lines.append(f"  {dependent.ref} ({dependent.kind}) at {dependent.folder}: {how}")
    lines.append("  (or bump their `version` to keep them as they are beside the new ones)")
    return "\n".join(lines)
