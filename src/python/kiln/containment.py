"""Writes stay in their folder: every path a Kiln process writes is resolved and checked first.

Artifact names and versions are safe path parts (kiln_contract.vocabulary), so the text
`{prefix}/{name}/{version}` cannot leave the prefix. What the text cannot show is the file
system: a symlink inside the store (`{prefix}/checkpoints -> /home`), or a `..` in a path given
on a command line. `within` resolves a path the way the kernel will (every existing symlink
followed, `..` applied) and refuses one that ends up outside the folder it must stay in. The
runner checks its output, the checkpoint folders and every input it places against the prefix
(or the explicit `--output` folder); the tokenizer checks its shard and cache folders against
the prefix it is given (docs/artifacts.md, "Containment").
"""

from __future__ import annotations

import os
from pathlib import Path


class OutsideRoot(ValueError):
    """A path that resolves outside the folder it must stay in."""


def within(path: str | os.PathLike[str], root: str | os.PathLike[str], what: str) -> Path:
    """`path`, resolved, if it lies in `root` (resolved too) or is `root` itself; else
    OutsideRoot naming `what`, the path and where it really points."""
    resolved_root = Path(root).resolve()
    resolved = Path(path).resolve()
    if resolved != resolved_root and resolved_root not in resolved.parents:
        raise OutsideRoot(
            f"{what} {path} resolves to {resolved}, outside {resolved_root}, where Kiln may "
            "write; nothing was written. Remove the symlink or `..` that leads out of it, or "
            "point the prefix at the folder you mean."
        )
    return resolved
