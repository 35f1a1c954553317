"""Published Llama weights a run starts from: `init_from=hf_model_source("org/model", revision=...)`
or `hf_model_source("/abs/folder")` (a folder is read where it is).

A hub model's folder comes through huggingface_hub's own cache, so its usual variables apply and reach
only this process: `HF_TOKEN` (or the token `huggingface-cli login` stored under `HF_HOME`) for
gated and private models, `HF_HOME` / `HF_HUB_CACHE` for where the cache is, `HF_ENDPOINT` for a
mirror, `HF_HUB_OFFLINE=1` to use only what is cached. None of them is in the step spec, the
fingerprint or the record. Only `config.json` and the safetensors weights are fetched, at the
pinned revision; a commit hash already in the cache is served without contacting the hub.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kiln.interop.errors import InteropError
from kiln.interop.llama_weights import Params
from kiln.interop.read import read_hf_config, read_hf_llama
from kiln.model.config import LlamaConfig
from kiln_contract.hf_llama import kiln_run_advice
from kiln_contract.layout import RECORD_FILE
from kiln_contract.llama import weights_differences
from kiln_contract.train import HfModelSource, ParentRun

# What reading a Llama needs: no tokenizer (the run has its own), no PyTorch or GGUF weights.
WEIGHT_FILES = ("config.json", "*.safetensors", "model.safetensors.index.json")


def hf_model_folder(source: HfModelSource) -> Path:
    """The model's folder: a local one as it is; a hub model's in the Hugging Face cache,
    downloaded there first if needed."""
    if source.is_local:
        local = Path(source.model)
        if not local.is_dir():
            raise InteropError(f"init_from: {local} is not a folder; give a transformers Llama folder")
        _refuse_a_kiln_run(local)
        return local
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"init_from: {source.label}"
    try:
        folder = snapshot_download(
            source.model, revision=source.revision, allow_patterns=list(WEIGHT_FILES)
        )
    except GatedRepoError:
        raise InteropError(
            f"{where} is a gated model: accept its terms on the hub, then set HF_TOKEN "
            "(or run `huggingface-cli login`)"
        ) from None
    except RepositoryNotFoundError:
        raise InteropError(
            f"{where}: no such model on the hub, or a private one: check the id, or set HF_TOKEN"
        ) from None
    except RevisionNotFoundError:
        raise InteropError(
            f"{where}: the model has no revision {source.revision!r}; give a commit hash, "
            "branch or tag it has"
        ) from None
    except LocalEntryNotFoundError:
        raise InteropError(
            f"{where} is not in the Hugging Face cache ({_cache_dir()}) and the hub cannot be "
            f"reached{_offline_reason()}; download it once with the hub reachable"
        ) from None
    except HfHubHTTPError as e:
        raise InteropError(f"{where}: the hub answered: {str(e).splitlines()[0]}") from None
    return Path(folder)


def _refuse_a_kiln_run(folder: Path) -> None:
    try:
        record = json.loads((folder / RECORD_FILE).read_text())
    except (OSError, ValueError):
        return
    advice = kiln_run_advice(str(folder), record) if isinstance(record, dict) else None
    if advice is not None:
        raise InteropError(f"init_from: {advice}")


def initial_params(
    source: HfModelSource, model_config: LlamaConfig, tokenizer: Any
) -> Mapping[str, Any]:
    """The weights at `source` as the parameter tree of Llama(model_config), float32; refuses
    weights of another architecture (naming each field that differs) or vocabulary size."""
    folder = hf_model_folder(source)
    check_architecture(read_hf_config(folder), model_config, source)
    params: Params = read_hf_llama(folder, tokenizer=tokenizer).params
    return params


def check_architecture(
    published: LlamaConfig, declared: LlamaConfig, source: HfModelSource | ParentRun
) -> None:
    """The run's `model=llama(...)` must be the architecture of the weights it starts from."""
    differing = weights_differences(declared.to_json(), published.to_json())
    if differing:
        raise InteropError(
            f"init_from: {source.label} is not the architecture `model` "
            f"declares ({'; '.join(differing)}); make `model=llama(...)` match the weights"
        )


def _cache_dir() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def _offline_reason() -> str:
    offline = os.environ.get("HF_HUB_OFFLINE", "")
    return f" (HF_HUB_OFFLINE={offline})" if offline not in ("", "0") else ""
