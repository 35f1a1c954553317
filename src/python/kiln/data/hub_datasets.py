"""Hugging Face hub datasets: their file lists at a revision, their files, their streams.

Every call goes through `huggingface_hub` (or `datasets`) as users have them, so `HF_TOKEN`,
`HF_ENDPOINT`, `HF_HOME` and the offline switches apply. A dataset is looked up once first
(`probe`): the clients retry an unreachable hub for ~25 s, and a gated, missing or private
dataset, or a revision that does not exist, deserves one line naming the dataset and what to
set. An id that is a local folder of data files is listed and read the same way, without a hub.
"""

from __future__ import annotations

import fnmatch
import functools
import os
import re
from pathlib import Path
from typing import Any

from kiln.data.errors import SourceError
from kiln_contract.tokenize import HfSource

# Hub file names that put a file in a split (datasets' own convention), by split.
SPLIT_WORDS = {
    "train": ("train", "training"),
    "validation": ("validation", "valid", "val", "dev"),
    "test": ("test", "testing", "eval", "evaluation"),
}
DATA_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".json", ".json.gz", ".json.zst", ".parquet")
PROBE_TIMEOUT_SECONDS = 10


def streamed(source: HfSource) -> bool:
    """A subset (a dataset config) or a record filter is read through `datasets` streaming."""
    return source.subset is not None or bool(source.where)


@functools.lru_cache(maxsize=8)
def hf_file_sizes(source: HfSource) -> dict[str, int]:
    """The files a hub source reads, repo path -> bytes, at its revision: those matching one of
    `data_files`; without data_files, the files whose path names the split as a word (a folder
    `train/`, a file `train-00000-of-00009.parquet`), or every data file for `train` when no file
    names any split. A local folder as the id is listed the same way."""
    folder = Path(source.id)
    listed = _list_folder(folder) if folder.exists() else _list_hub(source)
    data = {path: size for path, size in listed.items() if path.lower().endswith(DATA_SUFFIXES)}
    if source.data_files:
        chosen = {
            path: size
            for path, size in data.items()
            if any(fnmatch.fnmatchcase(path, pattern) for pattern in source.data_files)
        }
        wanted = f"matching data_files {list(source.data_files)}"
    else:
        chosen = _files_of_split(data, source.split)
        wanted = f"of the split {source.split!r}"
    if not chosen:
        raise SourceError(
            f"The Hugging Face dataset {source.id!r} at revision {source.revision!r} has no data "
            f"files {wanted}; its data files are: {sorted(data)[:20] or 'none'}."
        )
    return chosen


def _split_words(path: str) -> set[str]:
    return set(re.split(r"[/_.\-]", path.lower()))


def _files_of_split(data: dict[str, int], split: str) -> dict[str, int]:
    every_word = {word for words in SPLIT_WORDS.values() for word in words}
    if not any(_split_words(path) & every_word for path in data):
        return dict(data) if split == "train" else {}
    words = set(SPLIT_WORDS.get(split, (split,)))
    return {path: size for path, size in data.items() if _split_words(path) & words}


def _list_folder(folder: Path) -> dict[str, int]:
    return {
        path.relative_to(folder).as_posix(): path.stat().st_size
        for path in sorted(folder.rglob("*"))
        if path.is_file() and not any(p.startswith(".") for p in path.relative_to(folder).parts)
    }


def _list_hub(source: HfSource) -> dict[str, int]:
    if hf_offline():
        raise SourceError(
            f"Could not list the Hugging Face dataset {source.id!r} (revision "
            f"{source.revision!r}): Offline (HF_HUB_OFFLINE or HF_DATASETS_OFFLINE is set), and a "
            f"hub dataset's file list comes from the hub. {_advice()}"
        )
    from huggingface_hub import HfApi
    from huggingface_hub.hf_api import RepoFile

    probe(source)
    try:
        entries = HfApi().list_repo_tree(
            source.id, revision=source.revision, repo_type="dataset", recursive=True
        )
        return {entry.path: entry.size for entry in entries if isinstance(entry, RepoFile)}
    except Exception as e:  # the probe has named the likely causes; this is the rest
        raise SourceError(
            f"Could not list the files of the Hugging Face dataset {source.id!r} at revision "
            f"{source.revision!r}: {type(e).__name__}: {_first_line(e)}. {_advice()}"
        ) from None


def local_file(source: HfSource, path: str) -> Path:
    """A hub file on this machine: in the local folder, or downloaded once into the Hugging Face
    cache (HF_HOME / HF_HUB_CACHE) at the source's revision."""
    if Path(source.id).exists():
        return Path(source.id) / path
    from huggingface_hub import hf_hub_download

    try:
        return Path(hf_hub_download(source.id, path, revision=source.revision, repo_type="dataset"))
    except Exception as e:
        raise SourceError(
            f"Could not download {path} of the Hugging Face dataset {source.id!r} at revision "
            f"{source.revision!r}: {type(e).__name__}: {_first_line(e)}. {_advice()}"
        ) from None


def load_hf_dataset(source: HfSource) -> Any:
    """The streaming IterableDataset of `source`; a local dataset folder works as an id too.

    Unreachable hub: with HF_DATASETS_OFFLINE / HF_HUB_OFFLINE set, `datasets` fails in well under a
    second; without them it retries for ~25 s, so we probe the hub once first and fail at once.
    """
    import datasets

    is_local = Path(source.id).exists()
    if not is_local and not hf_offline():
        probe(source)
    try:
        return datasets.load_dataset(
            source.id,
            name=source.subset,
            data_files={source.split: list(source.data_files)} if source.data_files else None,
            split=source.split,
            revision=source.revision,
            streaming=True,
        )
    except Exception as e:  # datasets raises ConnectionError, FileNotFoundError, ValueError, ...
        offline = (
            " Offline (HF_HUB_OFFLINE or HF_DATASETS_OFFLINE is set): only the local Hugging Face "
            "cache (HF_HOME) is read, and it does not hold this dataset."
            if hf_offline() and not is_local
            else ""
        )
        raise SourceError(
            f"Could not load the Hugging Face dataset {source.id!r} (split {source.split!r}): "
            f"{type(e).__name__}: {_first_line(e)}.{offline} {_advice()}"
        ) from None


def probe(source: HfSource) -> None:
    """Looks the dataset up at its revision; SourceError names what keeps Kiln from reading it."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import (
        GatedRepoError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        HfApi().dataset_info(source.id, revision=source.revision, timeout=PROBE_TIMEOUT_SECONDS)
    except GatedRepoError:  # before RepositoryNotFoundError: it is one
        raise SourceError(
            f"The Hugging Face dataset {source.id!r} is gated: accept its terms on "
            f"huggingface.co with your account, then set HF_TOKEN to a token of that account "
            f"{_token_state()}."
        ) from None
    except RevisionNotFoundError:
        raise SourceError(
            f"The Hugging Face dataset {source.id!r} has no revision {source.revision!r}: "
            "check the target's `revision` field."
        ) from None
    except RepositoryNotFoundError:
        raise SourceError(
            f"The Hugging Face dataset {source.id!r} does not exist, or is private: check the id, "
            f"or set HF_TOKEN to a token that can read it {_token_state()}. {_advice()}"
        ) from None
    except Exception as e:  # connection errors come from httpx / requests, whichever hub uses
        raise SourceError(
            f"The Hugging Face hub is unreachable while looking up dataset {source.id!r} "
            f"({type(e).__name__}: {_first_line(e)}). {_advice()}"
        ) from None


def _token_state() -> str:
    return "(HF_TOKEN is set, but that token has no access)" if os.environ.get("HF_TOKEN") else (
        "(HF_TOKEN is not set)"
    )


def hf_offline() -> bool:
    return any(
        os.environ.get(var, "").upper() in ("1", "ON", "YES", "TRUE")
        for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")
    )


def _advice() -> str:
    return (
        "Without the hub, use a files source instead: download the data elsewhere as "
        'jsonl/parquet and point {"kind": "files", "paths": [...]} at it.'
    )


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else "no message"
