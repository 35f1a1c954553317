"""A Levanter/Marin token cache written the way Levanter writes one, for the import tests.

Levanter itself is not a dependency (it pins its own jax); this follows its source:
levanter/store/jagged_array.py (`_get_spec`, `_ts_open_sync`, `extend`) for the arrays,
levanter/store/cache.py (`CacheLedger`, `LEDGER_FILE_NAME`) for the ledger and
levanter/data/text.py (`BatchTokenizer.metadata`) for the tokenizer metadata.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import tensorstore as ts

# jagged_array.py: DEFAULT_CHUNK_SIZE and DEFAULT_WRITE_CHUNK_SIZE; arrays are 2**54 long.
INNER_CHUNK = 256 * 1024
WRITE_CHUNK = INNER_CHUNK * 512
ARRAY_LENGTH = 2**54


def _levanter_array(path: Path, dtype: str) -> ts.TensorStore:
    spec = {
        "driver": "zarr3",
        "kvstore": {"driver": "file", "path": str(path)},
        "metadata": {
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [WRITE_CHUNK]}},
            "codecs": [
                {
                    "name": "sharding_indexed",
                    "configuration": {
                        "chunk_shape": [INNER_CHUNK],
                        "codecs": [{"name": "blosc", "configuration": {"clevel": 5}}],
                    },
                }
            ],
        },
    }
    return ts.open(
        spec, dtype=dtype, shape=[ARRAY_LENGTH], create=True, delete_existing=True
    ).result()


def write_levanter_cache(
    split_dir: Path,
    documents: Sequence[np.ndarray],
    *,
    tokenizer: str,
    vocab_size: int | None,
    dtype: str = "int32",
    finished: bool = True,
) -> Path:
    """`documents` (token ids, EOS included) as Levanter's cache of one split at split_dir:
    `input_ids/{offsets,data}` and `shard_ledger.json`. `vocab_size` None: no metadata."""
    lengths = np.array([len(d) for d in documents], np.int64)
    data = _levanter_array(split_dir / "input_ids" / "data", dtype)
    offsets = _levanter_array(split_dir / "input_ids" / "offsets", "int64")
    if len(documents):
        data[: int(lengths.sum())].write(np.concatenate(documents).astype(dtype)).result()
        offsets[1 : len(documents) + 1].write(np.cumsum(lengths)).result()
    offsets[0].write(len(documents)).result()  # the row count last, as Levanter's extend()
    metadata: dict[str, Any] = {}
    if vocab_size is not None:
        metadata = {
            "preprocessor_metadata": {
                "tokenizer": tokenizer,
                "vocab_size": vocab_size,
                "return_attention_mask": False,
                "padding": False,
                "max_length": 1_000_000,
                "append_bos": False,
                "append_eos": True,
            }
        }
    ledger = {
        "total_num_rows": len(documents),
        "shard_rows": {"train-00000.jsonl.gz": len(documents)},
        "is_finished": finished,
        "finished_shards": ["train-00000.jsonl.gz"] if finished else [],
        "field_counts": {},
        "metadata": metadata,
    }
    (split_dir / "shard_ledger.json").write_text(json.dumps(ledger))
    return split_dir
