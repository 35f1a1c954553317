"""What produced an lm-eval score, logged beside it, and the summary lines that print both.

Metrics are floats (metrics.jsonl, W&B), so facts that are words travel in the key:

    lm_eval/{label}/num_fewshot            3.0     examples before each question
    lm_eval/{label}/num_docs               1000.0  documents scored (after max_examples)
    lm_eval/meta/harness=lm-eval 0.4.13    1.0     the harness that built the requests
    lm_eval/meta/sequence_start=tokenizer  1.0     kiln.eval.sequences' convention
    lm_eval/meta/max_length                2048.0  input tokens per scored sequence
    lm_eval/meta/chat_template=multiturn   1.0     only when the chat template is applied
"""

from __future__ import annotations

import importlib.metadata
import math
from collections.abc import Mapping
from typing import Any

from kiln.eval.tasks import EvalTask

PREFIX = "lm_eval/"
META = "meta"
HARNESS = "harness"
SEQUENCE_START = "sequence_start"
MAX_LENGTH = "max_length"
CHAT_TEMPLATE = "chat_template"
NUM_FEWSHOT = "num_fewshot"
NUM_DOCS = "num_docs"
# Per-entry keys that describe a score rather than being one.
_NOT_SCORES = (NUM_FEWSHOT, NUM_DOCS, "seconds", "sample_len")


def harness_version() -> str:
    return f"lm-eval {importlib.metadata.version('lm_eval')}"


def task_metadata(task: EvalTask, results: Mapping[str, Any]) -> dict[str, float]:
    """num_fewshot and num_docs of one suite entry, from lm-eval's evaluate() results."""
    return {
        f"{PREFIX}{task.label}/{NUM_FEWSHOT}": float(results["n-shot"][task.name]),
        f"{PREFIX}{task.label}/{NUM_DOCS}": float(results["n-samples"][task.name]["effective"]),
    }


def run_metadata(
    sequence_start: str, max_length: int, chat_template: str | None = None
) -> dict[str, float]:
    """The harness version and the conventions every score of this eval was computed with;
    `chat_template` ("multiturn" or "singleturn") only when lm-eval applied one."""
    meta = f"{PREFIX}{META}"
    metadata = {
        f"{meta}/{HARNESS}={harness_version()}": 1.0,
        f"{meta}/{SEQUENCE_START}={sequence_start}": 1.0,
        f"{meta}/{MAX_LENGTH}": float(max_length),
    }
    if chat_template is not None:
        metadata[f"{meta}/{CHAT_TEMPLATE}={chat_template}"] = 1.0
    return metadata


def eval_summary_lines(metrics: Mapping[str, Any]) -> list[str]:
    """The last lm-eval scores of a run (its summary.json metrics), each entry with its shots
    and documents, under a header naming the harness and conventions; [] when there are none."""
    entries: dict[str, dict[str, float]] = {}
    for key, value in sorted(metrics.items()):
        if key.startswith(PREFIX) and isinstance(value, (int, float)):
            label, _, name = key[len(PREFIX) :].partition("/")
            if name:
                entries.setdefault(label, {})[name] = float(value)
    meta = entries.pop(META, {})
    if not entries:
        return []
    lines = [f"lm-eval (last run; {_conventions(meta)})"]
    for label, values in entries.items():
        scores = {name: v for name, v in values.items() if not name.endswith(_NOT_SCORES)}
        if scores:
            lines.append(f"  {label}{_shots_and_docs(values)}")
            lines += [f"    {name:<36} {_number(v)}" for name, v in scores.items()]
    return lines


def _conventions(meta: Mapping[str, float]) -> str:
    words = [name for name in meta if "=" in name]  # harness=..., sequence_start=...
    if MAX_LENGTH in meta:
        words.append(f"{MAX_LENGTH}={meta[MAX_LENGTH]:.0f} input tokens")
    return ", ".join(words) or "harness and conventions not recorded"


def _shots_and_docs(values: Mapping[str, float]) -> str:
    facts = []
    if NUM_FEWSHOT in values:
        facts.append(f"{values[NUM_FEWSHOT]:.0f}-shot")
    if NUM_DOCS in values:
        facts.append(f"{values[NUM_DOCS]:.0f} docs")
    return f" ({', '.join(facts)})" if facts else ""


def _number(value: float) -> str:
    return f"{value:.4f}" if math.isfinite(value) else "n/a"
