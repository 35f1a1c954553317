"""What a store holds, artifact by artifact, and the removal of artifacts: `pants store`'s
runtime half (docs/artifacts.md, "Housekeeping").

    python -m kiln.artifacts.inventory STORE                    one JSON object: the artifacts
    python -m kiln.artifacts.inventory STORE --remove FOLDER... removes them; a JSON line
                                                                (a FolderOutcome) for each

An artifact is a folder `{name}/{version}/` that holds a record or a STATUS, together with its
siblings `.{version}.lease`, `.{version}.replaced/`, `.{version}.shards/` (a store-mode
cache's shards: they exist before the folder does) and `.{version}.holds/` (kiln.artifacts.holds:
the runs that need it kept, a training reading it or a cache's build between its shards). `.kiln/` and anything else that belongs to
no artifact is counted as one "other" entry and never removed. One listing of the store gives
every object's size and time; the records, STATUS and leases are then read all at once.

Every lease of an artifact protects it: its own `.{version}.lease` (a training, an export, an
evaluation, a merge, placing inputs) and any lease inside its folder or siblings (a store-mode
cache's `.{version}.shards/.shard-N.lease` while its shards tokenize, its holds). The inventory names a
live holder of any of them, and a removal keeps the artifact while one is live: it takes the
artifact's lease first (without waiting: a live holder keeps it, and the line says who), looks
for live leases inside, deletes STATUS before anything else (a half-removed folder never reads
as built), then the folder, its siblings and, last, the lease. Deciding *what* to remove (no
target names it, nothing kept was built from it) is the caller's.
"""

from __future__ import annotations

import json
import re
import sys
import time
from collections import defaultdict

from kiln.artifacts.folder import ArtifactFolder
from kiln.artifacts.holds import REMOVAL
from kiln.artifacts.lease import LeaseHeld, LeaseRecord, lease_key
from kiln.artifacts.locations import run_on_store
from kiln.artifacts.store import ListedObject, ObjectStore, read_texts
from kiln_contract.inventory import FolderOutcome, Inventory, StoredArtifact
from kiln_contract.layout import (
    HOLDS_SIBLING,
    RECORD_FILE,
    REPLACED_SIBLING,
    SHARDS_SIBLING,
    SIBLINGS,
    STATUS_FILE,
    sibling_key,
)

SERVICE_FOLDER = ".kiln"  # what Kiln keeps for the store's runs: not an artifact
# The siblings removed with an artifact, and searched for live leases before: all but its lease.
_CONTENT_SIBLINGS = (REPLACED_SIBLING, SHARDS_SIBLING, HOLDS_SIBLING)
_SIBLING = re.compile(rf"^\.(?P<version>.+)\.({'|'.join(SIBLINGS)})$")


def take_inventory(store: ObjectStore, now: float | None = None) -> Inventory:
    """Every artifact in the store, from one listing and one batch of reads."""
    listing = store.listing("")
    owned, other = _by_artifact(listing)
    folders = sorted(owned)
    names = [f"{f}/{n}" for f in folders for n in (STATUS_FILE, RECORD_FILE)]
    leases = [key for f in folders for key in _lease_keys(f, owned[f])]
    texts = read_texts(store, names + leases)
    now = time.time() if now is None else now
    artifacts = tuple(_artifact(folder, owned[folder], texts, now) for folder in folders)
    return Inventory(artifacts, len(other), sum(o.size for o in other))


def remove_artifact(store: ObjectStore, folder: str) -> str | None:
    """Removes the artifact `folder` under its lease; None when it is gone, else why it stays
    (a live lease: its own, or one inside it)."""
    artifact = ArtifactFolder(store, folder)
    try:
        with artifact.lease(f"{REMOVAL} {folder}").acquire(wait=False):
            inside = _live_leases_inside(store, folder)
            if inside:
                return f"a run holds a lease in it: {inside[0]}"
            store.remove_folder(folder, first=(STATUS_FILE,))
            for sibling in _CONTENT_SIBLINGS:
                store.remove_folder(sibling_key(folder, sibling))
    except LeaseHeld as e:
        return f"a run holds its lease: {e.holder.describe()}"
    store.prune(folder)  # its lease released: `name/` left empty goes too
    return None


def _live_leases_inside(store: ObjectStore, folder: str) -> list[str]:
    """The holders of live leases in the artifact's folder and siblings (not its own lease)."""
    keys = [
        f"{prefix}/{name}"
        for prefix in (folder, *(sibling_key(folder, s) for s in _CONTENT_SIBLINGS))
        for name in store.keys(prefix)
        if _is_lease(name)
    ]
    texts = read_texts(store, keys)
    now = time.time()
    return [holder for key in keys if (holder := _live_holder(texts[key], now)) is not None]


def _lease_keys(folder: str, objects: list[ListedObject]) -> list[str]:
    """Every lease of an artifact: its own, then any among its objects (shard leases)."""
    own = lease_key(folder)
    return [own, *(o.name for o in objects if _is_lease(o.name) and o.name != own)]


def _is_lease(name: str) -> bool:
    return name.rpartition("/")[2].endswith(".lease")


def _by_artifact(
    listing: list[ListedObject],
) -> tuple[dict[str, list[ListedObject]], list[ListedObject]]:
    """The objects of each artifact folder, and those of no artifact."""
    folders = {
        listed.name.rpartition("/")[0]
        for listed in listing
        if listed.name.rpartition("/")[2] in (STATUS_FILE, RECORD_FILE)
        and not any(part.startswith(".") for part in listed.name.split("/"))
    }
    folders = {f for f in folders if not any(_is_within(f, other) for other in folders)}
    owned: dict[str, list[ListedObject]] = defaultdict(list)
    other: list[ListedObject] = []
    for listed in listing:
        folder = _owner(listed.name, folders)
        if folder is None:
            other.append(listed)
        else:
            owned[folder].append(listed)
    return owned, other


def _owner(name: str, folders: set[str]) -> str | None:
    parts = name.split("/")
    for depth in range(1, len(parts)):
        if "/".join(parts[:depth]) in folders:
            return "/".join(parts[:depth])
    if parts[0] == SERVICE_FOLDER:
        return None
    for depth, part in enumerate(parts):
        sibling = _SIBLING.match(part)
        if sibling and depth > 0:  # an artifact's lease, aside or shards
            return "/".join([*parts[:depth], sibling["version"]])
    return None


def _is_within(folder: str, other: str) -> bool:
    return folder != other and folder.startswith(f"{other}/")


def _artifact(
    folder: str, objects: list[ListedObject], texts: dict[str, str | None], now: float
) -> StoredArtifact:
    status = texts[f"{folder}/{STATUS_FILE}"]
    record = _record(texts[f"{folder}/{RECORD_FILE}"])
    inputs = record.get("inputs") or []
    return StoredArtifact(
        folder=folder,
        status=None if status is None else status.strip(),
        kind=record.get("kind"),
        fingerprint=record.get("fingerprint"),
        inputs=tuple(str(i.get("ref")) for i in inputs if isinstance(i, dict)),
        objects=len(objects),
        size=sum(o.size for o in objects),
        modified=max(o.modified for o in objects),
        lease=next(
            (h for key in _lease_keys(folder, objects) if (h := _live_holder(texts[key], now))),
            None,
        ),
    )


def _record(text: str | None) -> dict:
    try:
        record = json.loads(text) if text is not None else {}
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}


def _live_holder(text: str | None, now: float) -> str | None:
    if text is None:
        return None
    try:
        holder = LeaseRecord.from_bytes(text.encode())
    except ValueError:
        return None  # unreadable: the next taker treats it as stale, and so does this
    return holder.describe() if holder.stale_reason(now) is None else None


def main(argv: list[str]) -> int:
    if not argv or (len(argv) > 1 and argv[1] != "--remove"):
        print(
            "usage: python -m kiln.artifacts.inventory STORE [--remove NAME/VERSION...]",
            file=sys.stderr,
        )
        return 2
    if len(argv) == 1:
        return run_on_store(argv[0], lambda store: print(take_inventory(store).to_json()))
    return run_on_store(argv[0], lambda store: _remove(store, argv[2:]))


def _remove(store: ObjectStore, folders: list[str]) -> None:
    for folder in folders:
        kept = remove_artifact(store, folder)
        print(FolderOutcome(folder, done=kept is None, kept=kept).to_json(), flush=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
