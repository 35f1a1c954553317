"""Helpers for the lm-eval tests: a word-level tokenizer, a bigram model whose answers we choose,
and local YAML tasks over JSONL files (no hub: HF_*_OFFLINE=1). conftest.py wraps them as fixtures."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"

from tokenizers import Tokenizer, models, pre_tokenizers, processors  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

EOS_ID = 0
WORDS = [f"w{i}" for i in range(48)]
BOS_ID = len(WORDS) + 2
VOCAB = {"<eos>": EOS_ID, "<unk>": 1, **{word: i + 2 for i, word in enumerate(WORDS)}, "<bos>": BOS_ID}
VOCAB_SIZE = len(VOCAB)
FORCED_LOGIT = 12.0  # makes a next token near-certain under the bigram model


def make_tokenizer(with_bos: bool = False) -> PreTrainedTokenizerFast:
    """Every word w0..w47 is one token; whitespace separates and is dropped. with_bos: the
    tokenizer starts every encoding with <bos> (its post-processor, as Llama 3's does)."""
    model = Tokenizer(models.WordLevel(VOCAB, unk_token="<unk>"))
    model.pre_tokenizer = pre_tokenizers.Whitespace()
    if not with_bos:
        return PreTrainedTokenizerFast(tokenizer_object=model, eos_token="<eos>", unk_token="<unk>")
    model.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", BOS_ID)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=model, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>"
    )


def make_bigram_logprob_fn(table: np.ndarray) -> Callable:
    """A jitted bigram LM: logits for the token after x are table[x]. Returns the adapter's
    (log_probs [B, T-1], is_argmax [B, T-1]) form."""
    table = jnp.asarray(table, jnp.float32)

    @jax.jit
    def logprob_fn(tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
        log_probs = jax.nn.log_softmax(table[tokens[:, :-1]], axis=-1)
        targets = tokens[:, 1:]
        picked = jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
        return picked, jnp.argmax(log_probs, axis=-1) == targets

    return logprob_fn


def bigram_sequence_logprob(table: np.ndarray, tokens: list[int]) -> float:
    """sum_t log p(tokens[t] | tokens[t-1]) in float64, computed directly from the table."""
    log_probs = table - np.log(np.exp(table).sum(axis=1, keepdims=True))
    return float(sum(log_probs[prev, tok] for prev, tok in zip(tokens[:-1], tokens[1:])))


@dataclass(frozen=True)
class LocalTasks:
    """Three local lm-eval tasks and the bigram table that decides their answers."""

    task_dir: Path
    table: np.ndarray
    mc_expected_acc: float
    lambada_expected_acc: float
    lambada_docs: list[str]
    rolling_docs: list[str]


MC_TASK = "kiln_test_mc"
LAMBADA_TASK = "kiln_test_lambada"
ROLLING_TASK = "kiln_test_rolling"


def write_local_tasks(root: Path) -> LocalTasks:
    rng = np.random.default_rng(0)
    table = rng.normal(size=(VOCAB_SIZE, VOCAB_SIZE))

    def token(word: str) -> int:
        return VOCAB[word]

    # Multiple choice: each query ends with its own cue word; the model strongly prefers one
    # choice after it. It prefers the gold choice in 4 of 6 docs: acc = acc_norm = 4/6 exactly.
    mc_docs = []
    for i in range(6):
        cue, choices, gold = WORDS[i], [WORDS[20 + i], WORDS[30 + i], WORDS[40 + i]], i % 3
        preferred = gold if i < 4 else (gold + 1) % 3
        table[token(cue), token(choices[preferred])] = FORCED_LOGIT
        mc_docs.append({"query": f"{WORDS[10 + i]} {cue}", "choices": choices, "gold": gold})
    mc_train = [{"query": f"{WORDS[12]} {WORDS[13]}", "choices": WORDS[14:17], "gold": 0}] * 3

    # Last-word prediction (lambada's shape): the last word is the argmax in 3 of 5 docs.
    lambada_docs = []
    for i in range(5):
        cue, target = WORDS[6 + i], WORDS[20 + i]
        forced = target if i < 3 else WORDS[30 + i]
        table[token(cue), token(forced)] = FORCED_LOGIT
        lambada_docs.append(f"{WORDS[40 + i]} {WORDS[41 + i]} {cue} {target}")

    # Perplexity: documents long enough to need several windows at small max_length.
    rolling_docs = [" ".join(rng.choice(WORDS, size=n)) for n in (150, 37, 90)]

    _write_jsonl(root / "mc_test.jsonl", mc_docs)
    _write_jsonl(root / "mc_train.jsonl", mc_train)
    _write_jsonl(root / "lambada_test.jsonl", [{"text": doc} for doc in lambada_docs])
    _write_jsonl(root / "rolling_test.jsonl", [{"text": doc} for doc in rolling_docs])
    cache = root / "hf_datasets_cache"
    _write_task_yaml(
        root / f"{MC_TASK}.yaml",
        MC_TASK,
        {"train": root / "mc_train.jsonl", "test": root / "mc_test.jsonl"},
        cache,
        """output_type: multiple_choice
training_split: train
test_split: test
doc_to_text: "{{query}}"
doc_to_choice: "{{choices}}"
doc_to_target: "{{gold}}"
metric_list:
  - {metric: acc, aggregation: mean, higher_is_better: true}
  - {metric: acc_norm, aggregation: mean, higher_is_better: true}
""",
    )
    _write_task_yaml(
        root / f"{LAMBADA_TASK}.yaml",
        LAMBADA_TASK,
        {"test": root / "lambada_test.jsonl"},
        cache,
        """output_type: loglikelihood
test_split: test
doc_to_text: "{{text.split(' ')[:-1]|join(' ')}}"
doc_to_target: "{{' '+text.split(' ')[-1]}}"
metric_list:
  - {metric: perplexity, aggregation: perplexity, higher_is_better: false}
  - {metric: acc, aggregation: mean, higher_is_better: true}
""",
    )
    _write_task_yaml(
        root / f"{ROLLING_TASK}.yaml",
        ROLLING_TASK,
        {"test": root / "rolling_test.jsonl"},
        cache,
        """output_type: loglikelihood_rolling
test_split: test
doc_to_text: ""
doc_to_target: "{{text}}"
metric_list:
  - {metric: word_perplexity}
  - {metric: byte_perplexity}
  - {metric: bits_per_byte}
""",
    )
    return LocalTasks(
        task_dir=root,
        table=table,
        mc_expected_acc=4 / 6,
        lambada_expected_acc=3 / 5,
        lambada_docs=lambada_docs,
        rolling_docs=rolling_docs,
    )


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def _write_task_yaml(
    path: Path, task: str, data_files: dict[str, Path], cache_dir: Path, body: str
) -> None:
    files = "\n".join(f"    {split}: {file}" for split, file in data_files.items())
    path.write_text(
        f"task: {task}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n{files}\n"
        f"  cache_dir: {cache_dir}\n{body}metadata:\n  version: 1.0\n"
    )


def write_hub_dataset_cache(
    cache_dir: Path, repo_id: str, config_name: str, splits: dict[str, list[dict]]
) -> Path:
    """Writes `splits` where `datasets.load_dataset(repo_id, config_name)` finds a hub dataset
    it downloaded before, `{cache_dir}/{namespace}___{name}/{config}/0.0.0/{hash}/` (Arrow files
    and dataset_info.json), using datasets' own builder: with HF_DATASETS_CACHE=cache_dir and
    HF_DATASETS_OFFLINE=1, lm-eval's task YAML for that dataset loads it as it is."""
    from datasets.packaged_modules.json.json import Json

    namespace, name = repo_id.split("/")
    staging = cache_dir / ".staging"
    staging.mkdir(parents=True, exist_ok=True)
    for split, rows in splits.items():
        _write_jsonl(staging / f"{split}.jsonl", rows)
    builder = Json(
        cache_dir=str(staging),
        dataset_name=name,
        config_name=config_name,
        config_id=config_name,
        hash="0" * 40,  # the hub's revision; any name for a cache written here
        data_files={split: str(staging / f"{split}.jsonl") for split in splits},
    )
    builder.download_and_prepare()
    # The builder names the folder after the dataset; a hub download prefixes its namespace.
    target = cache_dir / f"{namespace}___{name}"
    (staging / name).rename(target)
    return target
