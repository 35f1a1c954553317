"""The end-of-run summary a finished checkpoint prints: `write_run_summary(spec)`.

kiln.runner calls it once, after training, and prints the text; it is also written to
`output_path/summary.txt`, so that a later "already built" run prints it without restoring the
model or reading the caches again. It shows, in this order:

- the run, its steps and speed; where the artifact, its final checkpoint and loss curve are;
- the final training loss and, per validation set, the final validation loss next to the
  unigram baseline of the training mixture over the same positions (kiln.report.baseline);
- a few continuations sampled from the final model (kiln.model.sample) for prompts taken from
  the first validation set's first documents;
- the last lm-eval scores, each with its shots and documents, under the harness version and
  conventions they were computed with (kiln.eval.metadata).

It is made from what the trainer ends with (kiln.train.trainer.FinishedRun: its summary, its
opened caches and the final parameters, still on the trainer's mesh) and the artifact's loss
curve: nothing is restored or reopened.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from flax import nnx

from kiln.artifacts import SUMMARY_TEXT_FILE
from kiln.artifacts.atomic import atomic_write_text
from kiln.data.cache import TokenCache
from kiln.data.errors import KilnDataError
from kiln.eval.metadata import eval_summary_lines
from kiln.model.llama import abstract_llama
from kiln.report.plots import PLOT_FILE
from kiln.train.checkpoints import CheckpointInfo
from kiln.train.spec import TrainSpec
from kiln.train.trainer import FinishedRun

if TYPE_CHECKING:
    from kiln.data.tokenizer import LoadedTokenizer

NUM_SAMPLES = 3
PROMPT_TOKENS = 24
_UTF8_MAX_BYTES = 4  # a character's bytes: at most this many leading tokens hold part of one
_REPLACEMENT = "\ufffd"  # what a decoder makes of a character's bytes cut short
NEW_TOKENS = 40
TEMPERATURE = 0.8
SAMPLE_SEED = 0


def write_run_summary(run: FinishedRun) -> str:
    """Computes the summary of the finished run, writes it atomically to {output_path}/summary.txt
    and returns it. In a multi-host run every process computes it (the sampling is a
    collective) and process 0 writes it. Paths are shown where people find them (a bucket URL,
    for a run staged locally: TrainSpec.shown)."""
    text = format_run_summary(run)
    if jax.process_index() == 0:
        atomic_write_text(run.spec.output_path / SUMMARY_TEXT_FILE, text)
    return text


def format_run_summary(run: FinishedRun) -> str:
    spec, summary = run.spec, run.summary
    sections = [
        _run_lines(spec, summary) + _location_lines(spec, run.checkpoint),
        _loss_lines(spec, summary, run.caches),
        _sample_lines(run),
    ]
    sections += [eval_lines] if (eval_lines := eval_summary_lines(summary)) else []
    return "\n\n".join("\n".join(lines) for lines in sections) + "\n"


# --- what ran and where it is -----------------------------------------------------------------

def _run_lines(spec: TrainSpec, summary: dict[str, Any]) -> list[str]:
    state = "complete" if summary.get("complete") else "INCOMPLETE"
    speed = summary.get("tokens_per_second")
    wall = summary.get("wall_time_seconds")
    facts = [f"{summary.get('step')}/{spec.config.num_train_steps} steps, {state}"]
    if speed:
        facts.append(f"{speed:,.0f} tokens/s")
    if wall is not None:
        facts.append(f"{wall / 60:.1f} min this run")
    return [f"{spec.name} {spec.version}: {', '.join(facts)}"]


def _location_lines(spec: TrainSpec, checkpoint: CheckpointInfo | None) -> list[str]:
    shown, output_path = spec.shown, spec.output_path
    plot = output_path / PLOT_FILE
    missing = "" if plot.is_file() else "  (missing: no plot was written)"
    return [
        f"  artifact    {shown(output_path)}",
        f"  checkpoint  {shown(checkpoint.path) if checkpoint else 'none (no complete checkpoint)'}",
        f"  loss curve  {shown(plot)}{missing}",
    ]


# --- losses -------------------------------------------------------------------------------------


def _loss_lines(spec: TrainSpec, summary: dict[str, Any], caches: Sequence[TokenCache]) -> list[str]:
    """Final losses; each validation loss against the unigram baseline on the same positions."""
    cfg = spec.config
    set_names = spec.runtime.eval_names(cfg.validation)
    names = ["train (last step)", *set_names]
    width = max(map(len, names))
    lines = [
        "Final loss, nats/token (unigram: training-token frequencies alone, same positions)",
        f"  {names[0]:<{width}}  {_number(summary.get('train/loss'))}",
    ]
    for name, unigram in zip(set_names, _unigram_losses(spec, caches)):
        loss = summary.get(f"eval/{name}/loss")
        line = f"  {name:<{width}}  {_number(loss)}"
        if isinstance(unigram, str):
            line += f"  (no unigram baseline: {unigram})"
        else:
            line += f"  vs unigram {unigram:.3f}"
            if loss is not None:
                line += f": {loss - unigram:+.3f}"
        lines.append(line)
    return lines


def _unigram_losses(spec: TrainSpec, caches: Sequence[TokenCache]) -> list[float | str]:
    """Per validation set, its unigram cross-entropy, or why there is none. The positions are
    the trainer's validation windows: the first max_eval_batches x batch_size of seq_len (all
    of them without a maximum)."""
    from kiln.report.baseline import cross_entropy, unigram_log_probs

    cfg = spec.config
    train = list(zip(caches[: len(cfg.datasets)], (d.weight for d in cfg.datasets)))
    validation = caches[len(cfg.datasets) :]
    max_batches = spec.runtime.max_eval_batches
    windows = max_batches * cfg.batch_size if max_batches else None
    try:
        log_probs = unigram_log_probs(train)
    except ValueError as e:
        return [str(e)] * len(validation)
    losses: list[float | str] = []
    for cache in validation:
        try:
            losses.append(cross_entropy(log_probs, cache, cfg.seq_len, windows))
        except ValueError as e:
            losses.append(str(e))
    return losses


def _number(value: float | None) -> str:
    return "n/a" if value is None or not math.isfinite(value) else f"{value:.3f}"


# --- samples ------------------------------------------------------------------------------------


def _sample_lines(run: FinishedRun) -> list[str]:
    """Continuations of the first validation documents by the final model, or why there are
    none: samples are a convenience, so a missing tokenizer is a note, not an error."""
    from kiln.data.tokenizer import load_tokenizer, resolve_tokenizer_spec

    cfg, checkpoint = run.spec.config, run.checkpoint
    validation = run.caches[len(cfg.datasets) :]
    if not validation or checkpoint is None:
        return ["Samples: skipped (no validation set to take prompts from, or no checkpoint)"]
    cache = validation[0]
    search_from = [Path.cwd(), checkpoint.path]
    if isinstance(cache.path, Path):  # a cache in a bucket holds no tokenizer files to find
        search_from.append(cache.path)
    tokenizer_spec = resolve_tokenizer_spec(cache.info["tokenizer"].get("spec"), search_from)
    try:
        tokenizer = load_tokenizer(tokenizer_spec)
    except (KilnDataError, OSError, ValueError) as e:
        return [f"Samples: skipped (cannot load the tokenizer {tokenizer_spec}: {e})"]
    max_seq_len = run.model_config.max_seq_len
    graphdef, _ = abstract_llama(
        run.model_config, compute_dtype=cfg.compute_dtype, param_dtype=cfg.param_dtype
    )
    prompts = sample_prompts(cache, max_length=max_seq_len // 2)
    tokens = _generate(graphdef, run.params, prompts, max_seq_len)
    lines = [
        f"Samples from {checkpoint.path.name} (temperature {TEMPERATURE}, seed {SAMPLE_SEED}; "
        f"prompts: the first {'chats' if cache.masked else 'documents'} of "
        f"{cfg.validation[0].name}{', up to their first answer' if cache.masked else ''})"
    ]
    for i, row in enumerate(tokens, 1):
        continuation = up_to_eos(row[prompts.shape[1] :], cache.tokenizer.eos_id)
        lines.append(f"  [{i}] prompt: {shown_prompt(tokenizer, row[: prompts.shape[1]])!r}")
        lines.append(f"      model:  {tokenizer.decode(continuation.tolist())!r}")
    return lines


def _generate(
    graphdef: nnx.GraphDef, params: nnx.State, prompts: np.ndarray, max_seq_len: int
) -> np.ndarray:
    from kiln.model.sample import generate

    return generate(
        graphdef, params, prompts,
        max_new_tokens=min(NEW_TOKENS, max_seq_len - prompts.shape[1]),
        temperature=TEMPERATURE, seed=SAMPLE_SEED, max_seq_len=max_seq_len,
    )  # fmt: skip


def shown_prompt(tokenizer: LoadedTokenizer, prompt: np.ndarray) -> str:
    """The prompt's text from its first whole character, after "…" when it begins inside one: a
    prompt cut out of a document may start in the middle of a character's bytes (byte-level BPE
    tokens), which decode to U+FFFD. The model saw every token."""
    ids = prompt.tolist()
    for start in range(min(len(ids), _UTF8_MAX_BYTES)):
        text = tokenizer.decode(ids[start:])
        if not text.startswith(_REPLACEMENT):
            return f"…{text}" if start else text
    return tokenizer.decode(ids)


def up_to_eos(tokens: np.ndarray, eos_id: int | None) -> np.ndarray:
    """The continuation up to and including its first EOS: what follows is another document."""
    ends = np.flatnonzero(tokens == eos_id) if eos_id is not None else np.empty(0, np.int64)
    return tokens[: ends[0] + 1] if len(ends) else tokens


def sample_prompts(cache: TokenCache, *, max_length: int) -> np.ndarray:
    """int32 [n, P]: the first P tokens of the cache's first NUM_SAMPLES documents; of a chat or
    supervised cache, the P tokens before each one's first masked-in token (the conversation up
    to the assistant's turn, which the model then writes). One P for all (a batch): at most
    PROMPT_TOKENS and max_length, and short of every document's end (its EOS is no prompt)."""
    count = min(NUM_SAMPLES, cache.num_documents)
    docs = [cache.document(i) for i in range(count)]
    if cache.masked:
        answers = [int(np.argmax(cache.document_mask(i))) for i in range(count)]
        prompted = [(doc, start) for doc, start in zip(docs, answers) if start > 0]
        if prompted:
            length = min(PROMPT_TOKENS, max_length, *(start for _, start in prompted))
            return np.stack([doc[start - length : start] for doc, start in prompted]).astype(
                np.int32
            )
    length = max(1, min(PROMPT_TOKENS, max_length, *(len(doc) - 1 for doc in docs)))
    return np.stack([doc[:length] for doc in docs]).astype(np.int32)
