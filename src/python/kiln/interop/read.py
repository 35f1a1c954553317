"""A `transformers` Llama folder as Kiln's LlamaConfig and parameter tree (docs/interop.md).

`read_hf_llama(folder)` reads config.json and the safetensors weights (one file or sharded with
an index), refuses any model that is not a plain Llama (kiln.interop.llama_config names every
field that differs) or whose tensors do not match its config, and returns float32 parameters in
the tree `flax.nnx.to_pure_dict` gives for `kiln.model.llama.Llama(config)`. Given a tokenizer,
it also refuses a vocabulary of another size than the embedding.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.interop.errors import InteropError
from kiln.interop.llama_config import kiln_config
from kiln.interop.llama_weights import Params, from_hf_tensors
from kiln.interop.safetensors_folder import read_safetensors
from kiln.model.config import LlamaConfig

CONFIG_FILE = "config.json"


@dataclass(frozen=True)
class ImportedLlama:
    config: LlamaConfig
    params: Params


def read_hf_config(folder: Path) -> LlamaConfig:
    """The LlamaConfig of the folder's config.json (no weights read)."""
    path = Path(folder) / CONFIG_FILE
    try:
        hf = json.loads(path.read_text())
    except OSError as e:
        raise InteropError(
            f"cannot read {path}: {e.strerror}; is {folder} a model folder?"
        ) from None
    except ValueError as e:
        raise InteropError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(hf, dict):
        raise InteropError(f"{path} holds {type(hf).__name__}, not a config object")
    return kiln_config(hf, source=str(path))


def read_hf_llama(folder: Path, *, tokenizer: Any = None) -> ImportedLlama:
    """The model in `folder`; `tokenizer` (a kiln.data.tokenizer.TokenizerInfo, optional) is
    the vocabulary the parameters will be used with."""
    folder = Path(folder)
    config = read_hf_config(folder)
    if tokenizer is not None and tokenizer.vocab_size != config.vocab_size:
        raise InteropError(
            f"{folder} has vocab_size {config.vocab_size} but tokenizer {tokenizer.name!r} has "
            f"{tokenizer.vocab_size} tokens; use the tokenizer the model was trained with"
        )
    params = from_hf_tensors(read_safetensors(folder), config, source=str(folder))
    return ImportedLlama(config, params)
