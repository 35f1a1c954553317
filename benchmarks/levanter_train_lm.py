"""Levanter's side of benchmarks/vs_levanter.py: its own cache builder and `train_lm.main`.

Built as a PEX from the levanter-tests resolve (`./pants package benchmarks:levanter-train`) and
run by vs_levanter.py, never imported by it:

    python levanter-train.pex build-cache --corpus C.jsonl --tokenizer DIR --cache DIR
    python levanter-train.pex train --corpus C.jsonl --tokenizer DIR --cache DIR --out DIR
        [--steps 300 --batch 16 --seq-len 128 --seed 0 --data-seed N --scan-layers
         --hf-out DIR]

`build-cache` tokenizes the corpus into `DIR/stdlib/train`, the folder `train_lm` reads for its
component `stdlib` (levanter.data.text.cache.build_lm_dataset_cache, EOS appended). `train`
runs `levanter.main.train_lm.main` with the quickstart's model and optimizer: 2 layers, d 128,
4/2 heads, untied, rope theta 5e5, eps 1e-5; adam(3e-3, weight_decay 0.033, warmup 50,
min_lr_ratio 0.1) with Levanter's beta2 0.95, epsilon 1e-8, clipping 1.0, cosine; z-loss 1e-4;
float32 (Levanter's default policy); Levanter's defaults for the rest (gradient checkpointing;
`scan_layers` as given). Its tracker writes one JSON line per log call, with the time, to
`OUT/metrics.jsonl`. With `--hf-out`, train_lm's own HF export writes the final weights to
`DIR/step-N` (a transformers Llama folder).
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

from levanter.data.text.cache import build_lm_dataset_cache
from levanter.data.text.datasets import DatasetComponent, LmDataConfig, UrlDatasetSourceConfig
from levanter.data.text.formats import TextLmDatasetFormat
from levanter.layers.rotary import DefaultRotaryEmbeddingsConfig
from levanter.main.train_lm import TrainLmConfig, main
from levanter.models.llama import LlamaConfig
from levanter.optim.config import AdamConfig
from levanter.tokenizers import load_tokenizer

COMPONENT = "stdlib"


def build_cache(args: argparse.Namespace) -> None:
    source = UrlDatasetSourceConfig(train_urls=[str(args.corpus)]).get_shard_source("train")
    started = time.monotonic()
    folder = args.cache / COMPONENT / "train"
    build_lm_dataset_cache(str(folder), source, TextLmDatasetFormat(), load_tokenizer(str(args.tokenizer)))
    print(json.dumps({"cache": str(folder), "seconds": round(time.monotonic() - started, 1)}))


class _TimedJson(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return json.dumps({"time": record.created, **json.loads(record.getMessage())})


def train(args: argparse.Namespace) -> None:
    from levanter.checkpoint import CheckpointerConfig
    from levanter.tracker.json_logger import JsonLoggerConfig
    from levanter.trainer import TrainerConfig

    args.out.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(args.out / "metrics.jsonl")
    handler.setFormatter(_TimedJson())
    logging.getLogger("levanter.json_logger").addHandler(handler)
    tokenizer = str(args.tokenizer)
    config = TrainLmConfig(
        data=LmDataConfig(
            tokenizer=tokenizer,
            cache_dir=str(args.cache),
            components={COMPONENT: DatasetComponent(
                source=UrlDatasetSourceConfig(train_urls=[str(args.corpus)]))},
            train_weights={COMPONENT: 1.0},
            auto_build_caches=False,
        ),  # fmt: skip
        trainer=TrainerConfig(
            seed=args.seed,
            num_train_steps=args.steps,
            train_batch_size=args.batch,
            tracker=JsonLoggerConfig(),
            require_accelerator=False,
            log_jaxprs=False,
            log_xla_hlo=False,
            load_checkpoint=False,
            id=args.out.name,
            log_dir=args.out / "logs",
            steps_per_eval=10 * args.steps,
            checkpointer=CheckpointerConfig(
                base_path=str(args.out / "checkpoints"), save_interval=None, keep=None
            ),
        ),
        model=LlamaConfig(
            max_seq_len=256, hidden_dim=128, intermediate_dim=512, num_layers=2, num_heads=4,
            num_kv_heads=2, layer_norm_epsilon=1e-5, tie_word_embeddings=False,
            rope=DefaultRotaryEmbeddingsConfig(theta=500000.0), tokenizer=tokenizer,
            scan_layers=args.scan_layers,
        ),  # fmt: skip
        train_seq_len=args.seq_len,
        optimizer=AdamConfig(learning_rate=3e-3, weight_decay=0.033, warmup=50, min_lr_ratio=0.1),
        z_loss_weight=1e-4,
        data_seed=args.data_seed,
        hf_save_path=None if args.hf_out is None else str(args.hf_out),
        hf_save_steps=args.steps,
    )
    main(config)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["build-cache", "train"])
    parser.add_argument("--corpus", type=Path, required=True)
    parser.add_argument("--tokenizer", type=Path, required=True)
    parser.add_argument("--cache", type=Path, required=True)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data-seed", type=int)
    parser.add_argument("--hf-out", type=Path, help="train_lm's HF export of the final weights")
    parser.add_argument("--scan-layers", action=argparse.BooleanOptionalAction, default=True)
    return parser.parse_args()


if __name__ == "__main__":
    arguments = parse_args()
    build_cache(arguments) if arguments.command == "build-cache" else train(arguments)
