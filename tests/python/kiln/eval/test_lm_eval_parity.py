"""Kiln's lm-eval numbers equal lm-eval's own Hugging Face runner on the same model.

A small Kiln Llama (random weights, spread enough that every score differs) is exported with
kiln.interop and scored twice on three local tasks: by lm-eval's `hf` model (HFLM over
transformers' LlamaForCausalLM on PyTorch, lm_eval_reference.py in the torch-tests PEX, one
process for everything) and by Kiln (KilnLM over `make_logprob_fn`, the trainer's own path, and
`run_eval_suite`). The tasks: multiple choice with real-text distractors at 2 shots (contexts
longer than the model's 64 tokens, so truncation matters), a last-word task whose targets are
in part the model's greedy continuation (so is_greedy is both true and false) with one empty
context, and perplexity on documents several windows long. Both a tokenizer without BOS (the
quickstart's) and one whose post-processor adds BOS (the quickstart's given one,
kiln_testing.data.bos_tokenizer_folder).
The multiple-choice task runs twice more through the BOS tokenizer's chat template (a Jinja
template that writes BOS itself), both sides with lm-eval's `apply_chat_template` and few-shot
examples as chat turns, and once more at 0 shots with a `system_instruction` (a system turn
first, no context truncated): the same rendered contexts, encoded without a second BOS.

Per request, log-likelihoods agree within 1e-4 and greedy flags exactly; every metric agrees
within 1e-4 relative. The numbers are checked against the runner at float64, Kiln at float32: at
float32 lm-eval sums each window's log-probs in float32 (a window sums to ~10^2-10^3 nats, whose
float32 spacing is ~10^-5-10^-4), so two float32 runners differ on a several-window document by
rounding alone, ~1e-4; the float64 runner makes the check measure Kiln's error (RESULTS.md has
both runners' numbers).
"""

from __future__ import annotations

import copy
import functools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from kiln_testing.data import BOS, STDLIB_TOKENIZER, bos_tokenizer_folder
from lm_eval.api.instance import Instance
from lm_eval.evaluator import evaluate

from kiln.data.tokenizer import load_tokenizer
from kiln.eval.adapter import KilnLM
from kiln.eval.harness import load_suite_tasks, run_eval_suite
from kiln.eval.sequences import ScoredSequence, rolling_windows, scored_pair, sequence_convention
from kiln.eval.tasks import EvalSuiteConfig
from kiln.interop.export import write_hf_llama
from kiln.model.config import LlamaConfig
from kiln.model.llama import Llama
from kiln.train.step import make_logprob_fn

# Where Pants puts tests/python/kiln/interop:hf-reference (BUILD: runtime_package_dependencies).
REFERENCE_PEX = Path("tests.python.kiln.interop/hf-reference.pex")
REFERENCE_MODULE = "kiln.eval.lm_eval_reference"
MAX_SEQ_LEN = 64
TOLERANCE = 1e-4
TASKS = {"parity_mc": 2, "parity_last_word": 0, "parity_rolling": 0}  # name -> num_fewshot
TOKENIZERS = ("no-bos", "bos")
CHAT = "bos-chat"  # the BOS tokenizer with CHAT_TEMPLATE, lm-eval's apply_chat_template on
CHAT_SYSTEM = "bos-chat-system"  # the same with lm-eval's system_instruction, at 0 shots
CHATS = {CHAT: None, CHAT_SYSTEM: "Choose the words that come next."}  # side -> instruction
# At 0 shots no context is truncated: every scored sequence holds the system turn.
CHAT_TASKS = {CHAT: {"parity_mc": 2}, CHAT_SYSTEM: {"parity_mc": 0}}
SIDE_TASKS = {**{side: TASKS for side in TOKENIZERS}, **CHAT_TASKS}
CASES = [(side, task) for side, tasks in SIDE_TASKS.items() for task in tasks]
REFERENCE_DTYPE = "float64"
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{{ message['content'] }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def prose() -> list[str]:
    """Sentences of English prose: Python's own documentation."""
    from pydoc_data.topics import topics

    text = " ".join(topics[name] for name in sorted(topics)[:60])
    words = text.split()
    return [" ".join(words[i : i + 30]) for i in range(0, len(words) - 30, 30)]


def kiln_model(vocab_size: int, seed: int) -> tuple[LlamaConfig, nnx.GraphDef, nnx.State]:
    config = LlamaConfig(
        max_seq_len=MAX_SEQ_LEN, hidden_dim=64, intermediate_dim=160, num_heads=4,
        num_kv_heads=2, num_layers=2, vocab_size=vocab_size,
        init_std=0.2,  # logits spread over several units: no near-ties between choices
    )  # fmt: skip
    model = Llama(config, rngs=nnx.Rngs(seed), compute_dtype=jnp.float32, attention="xla")
    graphdef, state = nnx.split(model)
    return config, graphdef, state


def write_tasks(folder: Path, sentences: list[str], greedy: list[tuple[str, str]]) -> None:
    """The three tasks' YAML, their data in JSONL files beside them."""
    rng = np.random.default_rng(0)
    mc = []
    for i, sentence in enumerate(sentences[:40]):  # the next 3 words, or 3 words from elsewhere
        words = sentence.split()
        others = [" ".join(sentences[(i + 7 * k) % 60].split()[12:15]) for k in (1, 2, 3)]
        gold = int(rng.integers(4))
        choices = [*others[:gold], " ".join(words[12:15]), *others[gold:]]
        mc.append({"query": " ".join(words[:12]), "choices": choices, "gold": gold})
    last_word = [{"context": context, "target": target} for context, target in greedy]
    for sentence in sentences[40:52]:  # the true next words: rarely the model's choice
        words = sentence.split()
        last_word.append({"context": " ".join(words[:-2]), "target": " " + " ".join(words[-2:])})
    last_word.append({"context": "", "target": sentences[52].split()[0]})  # an empty context
    rolling = [{"text": " ".join(sentences[60 + 5 * i : 64 + 5 * i])} for i in range(4)]

    write_task(folder, "parity_mc", {"train": mc[:8], "test": mc[8:]}, """\
output_type: multiple_choice
training_split: train
doc_to_text: "Text: {{query}}\\nNext:"
doc_to_choice: "{{choices}}"
doc_to_target: "{{gold}}"
metric_list: [{metric: acc}, {metric: acc_norm}]
""")
    write_task(folder, "parity_last_word", {"test": last_word}, """\
output_type: loglikelihood
target_delimiter: ""
doc_to_text: "{{context}}"
doc_to_target: "{{target}}"
metric_list:
  - {metric: perplexity, aggregation: perplexity, higher_is_better: false}
  - {metric: acc, aggregation: mean, higher_is_better: true}
""")
    write_task(folder, "parity_rolling", {"test": rolling}, """\
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{text}}"
metric_list: [{metric: word_perplexity}, {metric: byte_perplexity}, {metric: bits_per_byte}]
""")


def write_task(folder: Path, name: str, splits: dict[str, list[dict]], body: str) -> None:
    files = ""
    for split, rows in splits.items():
        path = folder / f"{name}_{split}.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        files += f"    {split}: {path}\n"
    (folder / f"{name}.yaml").write_text(
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n{files}"
        f"  cache_dir: {folder / 'hf_datasets_cache'}\ntest_split: test\n{body}"
        "metadata: {version: 1.0}\n"
    )


def greedy_last_words(
    tokenizer: Any, graphdef: nnx.GraphDef, state: nnx.State, sentences: list[str]
) -> list[tuple[str, str]]:
    """(context, target) pairs whose one-token target is the model's argmax after the context
    as the tokenizer encodes it (its own BOS included): is_greedy is true for them."""
    hf = tokenizer.hf_tokenizer
    model = nnx.merge(graphdef, state)
    pairs = []
    for sentence in sentences:
        context = " ".join(sentence.split()[:10])
        ids = hf.encode(context)
        best = int(np.argmax(np.asarray(model(jnp.asarray([ids])))[0, -1]))
        target = hf.decode([best])
        is_word = target.startswith(" ") and target[1:].isalpha()
        if is_word and hf.encode(context + target) == [*ids, best]:
            pairs.append((context, target))
    return pairs


def run_reference(jobs: list[dict[str, Any]], folder: Path) -> list[dict[str, Any]]:
    """Runs the jobs in one lm-eval + transformers process; returns its report per job."""
    jobs_file = folder / "jobs.json"
    jobs_file.write_text(json.dumps(jobs))
    # The PEX's own environment, not this test's (Pants sets PEX_* for the test's PEX); a shared
    # PEX_ROOT keeps what the reference PEX unpacks across runs.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PEX")}
    env["PEX_ROOT"] = str(Path(tempfile.gettempdir()) / "kiln-tests-pex-root")
    env["PEX_MODULE"] = REFERENCE_MODULE
    env["HF_HOME"] = str(folder / "hf_home")
    result = subprocess.run(
        [sys.executable, str(REFERENCE_PEX), str(jobs_file)],
        env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert result.returncode == 0, f"lm-eval's runner failed:\n{result.stderr[-4000:]}"
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


def kiln_responses(lm: KilnLM, requests: list[dict[str, Any]]) -> list[list[Any]]:
    """Kiln's answers to exactly the requests lm-eval's runner answered, in its order."""
    arguments = [tuple(args) for request in requests for args in request["arguments"]]
    if len(arguments[0]) == 1:  # loglikelihood_rolling: (text,)
        instances = [Instance("loglikelihood_rolling", {}, a, i) for i, a in enumerate(arguments)]
        return [[total] for total in lm.loglikelihood_rolling(instances)]
    instances = [Instance("loglikelihood", {}, a, i) for i, a in enumerate(arguments)]
    return [[total, greedy] for total, greedy in lm.loglikelihood(instances)]


def reference_responses(requests: list[dict[str, Any]]) -> list[list[Any]]:
    answers = [resps[0] for request in requests for resps in request["resps"]]
    return [answer if isinstance(answer, list) else [answer] for answer in answers]


def kiln_sequences(tokenizer: Any, recorded: list[dict[str, Any]]) -> list[ScoredSequence]:
    """The sequences Kiln builds from the texts lm-eval's runner scored, in the runner's order:
    a request's pair, or a rolling document's windows."""
    convention = sequence_convention(tokenizer, "tokenizer")
    sequences = []
    for entry in recorded:
        if "documents" in entry:
            for text in entry["documents"]:
                tokens = convention.document(text)
                sequences += rolling_windows(tokens, convention.prefix_id, MAX_SEQ_LEN)
        elif entry["request"] is not None:  # None: a window of the documents above
            context, continuation = convention.pair(*entry["request"])
            sequences.append(scored_pair(context, continuation, MAX_SEQ_LEN))
    return sequences


def reference_sequences(recorded: list[dict[str, Any]]) -> list[ScoredSequence]:
    """What HFLM's `_loglikelihood_tokens` scored: (context + continuation)[-(max_length + 1):],
    the continuation's tokens summed."""
    return [
        ScoredSequence([*e["context"], *e["continuation"]][-(MAX_SEQ_LEN + 1) :],
                       len(e["continuation"]))
        for e in recorded
        if "context" in e
    ]  # fmt: skip


@pytest.fixture(scope="module")
def parity(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Both tokenizers' models, scored by lm-eval's runner and by Kiln."""
    if not REFERENCE_PEX.exists():
        pytest.fail(f"{REFERENCE_PEX} is missing: run this test with `./pants test` (BUILD)")
    folder = tmp_path_factory.mktemp("lm_eval_parity")
    sentences = prose()
    sides, jobs = {}, []
    for seed, name in enumerate(TOKENIZERS):
        tokenizer_dir = Path(STDLIB_TOKENIZER["path"])
        if name == "bos":
            tokenizer_dir = bos_tokenizer_folder(folder / "bos-tokenizer")
        tokenizer = load_tokenizer({"kind": "local", "path": str(tokenizer_dir)})
        config, graphdef, state = kiln_model(tokenizer.info.vocab_size, seed)
        model_dir = write_hf_llama(
            folder / f"model-{name}", config, nnx.to_pure_dict(state), tokenizer
        )
        task_dir = folder / f"tasks-{name}"
        task_dir.mkdir()
        greedy = greedy_last_words(tokenizer, graphdef, state, sentences[70:130])
        write_tasks(task_dir, sentences, greedy)
        jobs.append({"model": str(model_dir), "task_dir": str(task_dir), "tasks": list(TASKS),
                     "num_fewshot": TASKS, "batch_size": 8, "dtype": REFERENCE_DTYPE,
                     "out": str(folder / f"reference-{name}.json")})  # fmt: skip
        logprob_fn = functools.partial(make_logprob_fn(graphdef, with_is_argmax=True), state)
        sides[name] = (tokenizer, logprob_fn, task_dir)
        if name == "bos":  # the same model and tasks, its tokenizer with a chat template
            chat_tokenizer = copy.deepcopy(tokenizer)
            chat_tokenizer.hf_tokenizer.chat_template = CHAT_TEMPLATE
            chat_dir = write_hf_llama(
                folder / f"model-{CHAT}", config, nnx.to_pure_dict(state), chat_tokenizer
            )
            chat_jobs = [
                {**jobs[-1], "model": str(chat_dir), "tasks": list(CHAT_TASKS[side]),
                 "num_fewshot": CHAT_TASKS[side], "out": str(folder / f"reference-{side}.json"),
                 "apply_chat_template": True, "system_instruction": instruction}
                for side, instruction in CHATS.items()
            ]  # fmt: skip
            sides.update({side: (chat_tokenizer, logprob_fn, task_dir) for side in CHATS})
    jobs += chat_jobs
    reports = run_reference(jobs, folder)

    results = {}
    for (name, (tokenizer, logprob_fn, task_dir)), job, report in zip(sides.items(), jobs, reports):
        reference = json.loads(Path(job["out"]).read_text())
        tasks = SIDE_TASKS[name]
        lm = KilnLM(logprob_fn, tokenizer, max_length=MAX_SEQ_LEN)
        suite = {"tasks": [{"name": task, "num_fewshot": shots} for task, shots in tasks.items()],
                 "every": 1, "task_paths": [str(task_dir)]}  # fmt: skip
        if name in CHATS:
            suite.update(apply_chat_template=True, system_instruction=CHATS[name])
        sequences = {task: kiln_sequences(tokenizer, reference[task]["sequences"]) for task in tasks}
        results[name] = {
            "tokenizer": tokenizer,
            "report": report,
            "reference": reference,
            "sequences": sequences,
            "sequence_scores": {task: lm.score_sequences(sequences[task]) for task in tasks},
            "responses": {task: kiln_responses(lm, reference[task]["requests"]) for task in tasks},
            "metrics": run_eval_suite(
                logprob_fn, tokenizer, suite, step=0, model_max_length=MAX_SEQ_LEN
            ),
        }
        if name in CHATS:
            results[name]["requests"] = kiln_requests(lm, suite)
    print_largest_differences(results)
    return results


def kiln_requests(lm: KilnLM, suite: dict[str, Any]) -> dict[str, list[list[list[str]]]]:
    """The request arguments lm-eval builds through Kiln's LM with the suite's chat flags: each
    document's (context, continuation) pairs, in lm-eval's sample order."""
    config = EvalSuiteConfig.from_json(suite)
    requests = {}
    for task, task_dict in zip(config.tasks, load_suite_tasks(config, model_max_length=MAX_SEQ_LEN)):
        results = evaluate(
            lm, task_dict, bootstrap_iters=0, log_samples=True,
            apply_chat_template=config.apply_chat_template, fewshot_as_multiturn=config.multiturn,
            system_instruction=config.system_instruction,
        )  # fmt: skip
        requests[task.name] = [
            [list(args) for args in sample["arguments"]] for sample in results["samples"][task.name]
        ]
    return requests


def print_largest_differences(results: dict[str, dict[str, Any]]) -> None:
    """The measured agreement (docs/evals.md), shown with `--test-output=all`: the largest
    per-request |difference| of log-likelihood (a rolling document's total), per window, and the
    largest relative metric difference."""
    for side, run in results.items():
        for task in SIDE_TASKS[side]:
            kiln = [r[0] for r in run["responses"][task]]
            windows = [score for score, _ in run["sequence_scores"][task]]
            scored = run["reference"][task]
            expected = [r[0] for r in reference_responses(scored["requests"])]
            per_window = [e["result"][0] for e in scored["sequences"] if "result" in e]
            metric = max(
                abs(run["metrics"][f"lm_eval/{task}/{key.split(',')[0]}"] / value - 1)
                for key, value in scored["metrics"].items()
                if "_stderr" not in key and value != 0
            )
            print(
                f"{side:7} {task:17} vs {REFERENCE_DTYPE}: max |d ll| "
                f"{largest_gap(kiln, expected):.2e}  per window "
                f"{largest_gap(windows, per_window):.2e}  max metric rel {metric:.2e}"
            )


def largest_gap(kiln: list[float], reference: list[float]) -> float:
    return max(abs(k - r) for k, r in zip(kiln, reference, strict=True))


@pytest.mark.parametrize(("side", "task"), CASES)
def test_the_same_token_sequences(parity: dict, side: str, task: str) -> None:
    """Token for token: prefix rules, context/continuation split, truncation, rolling windows
    and their lengths."""
    run = parity[side]
    reference = reference_sequences(run["reference"][task]["sequences"])
    assert len(reference) > 0
    assert run["sequences"][task] == reference


@pytest.mark.parametrize(("side", "task"), CASES)
def test_every_sequence_scores_the_same(parity: dict, side: str, task: str) -> None:
    run = parity[side]
    reference = [e["result"] for e in run["reference"][task]["sequences"] if "result" in e]
    kiln = run["sequence_scores"][task]
    worst = max(abs(k[0] - r[0]) for k, r in zip(kiln, reference, strict=True))
    assert worst <= TOLERANCE, f"max |log-likelihood difference| {worst:.3g}"
    assert [k[1] for k in kiln] == [r[1] for r in reference]  # greedy flags


@pytest.mark.parametrize(("side", "task"), CASES)
def test_every_request_scores_the_same(parity: dict, side: str, task: str) -> None:
    """Through lm-eval's LM interface: a loglikelihood request or a rolling document's total
    within 1e-4."""
    run = parity[side]
    reference = reference_responses(run["reference"][task]["requests"])
    kiln = run["responses"][task]
    assert len(kiln) == len(reference) > 0
    worst = max(abs(k[0] - r[0]) for k, r in zip(kiln, reference))
    assert worst <= TOLERANCE, f"max |log-likelihood difference| {worst:.3g}"
    if task != "parity_rolling":  # rolling requests have no greedy flag
        assert [k[1] for k in kiln] == [r[1] for r in reference]


@pytest.mark.parametrize(("side", "task"), CASES)
def test_every_metric_is_the_same(parity: dict, side: str, task: str) -> None:
    run = parity[side]
    reference = {
        key.split(",")[0]: value
        for key, value in run["reference"][task]["metrics"].items()
        if "_stderr" not in key
    }
    kiln = {name: run["metrics"][f"lm_eval/{task}/{name}"] for name in reference}
    assert kiln == pytest.approx(reference, rel=TOLERANCE)
    assert run["metrics"][f"lm_eval/{task}/num_fewshot"] == SIDE_TASKS[side][task]


@pytest.mark.parametrize("side", CHATS)
def test_kiln_renders_the_chat_template_as_lm_evals_runner(parity: dict, side: str) -> None:
    """lm-eval builds the same requests through KilnLM.apply_chat_template as through HFLM's:
    the system instruction's turn, few-shot examples as user/assistant turns, the template's BOS
    first, no second BOS."""
    run = parity[side]
    reference = [r["arguments"] for r in run["reference"]["parity_mc"]["requests"]]
    assert run["requests"]["parity_mc"] == reference
    contexts = [args[0] for arguments in reference for args in arguments]
    system = "" if CHATS[side] is None else f"<|system|>\n{CHATS[side]}\n"
    start = f"{BOS}{system}<|user|>\n"
    assert all(c.startswith(start) and c.endswith("<|assistant|>\n") for c in contexts)
    turns = SIDE_TASKS[side]["parity_mc"] + 1  # the shots, then the prompt
    assert all(c.count("<|assistant|>") == turns for c in contexts)
    bos_id = run["tokenizer"].info.bos_id
    assert all(s.tokens.count(bos_id) <= 1 for s in run["sequences"]["parity_mc"])
    if CHATS[side] is not None:  # scored whole, from BOS: the system turn counts
        assert all(s.tokens[0] == bos_id for s in run["sequences"]["parity_mc"])
    assert run["metrics"]["lm_eval/meta/chat_template=multiturn"] == 1.0
    assert not any("chat_template" in key for key in parity["bos"]["metrics"])


@pytest.mark.parametrize("side", TOKENIZERS)
def test_the_runner_ran_with_lm_evals_defaults(parity: dict, side: str) -> None:
    run = parity[side]
    info = run["tokenizer"].info
    assert run["report"]["max_length"] == MAX_SEQ_LEN  # max_position_embeddings
    assert run["report"]["bos_token_id"] == info.bos_id
    assert (info.bos_id is None) == (side == "no-bos")
    assert run["report"]["prefix_token_id"] == (info.eos_id if side == "no-bos" else info.bos_id)


@pytest.mark.parametrize("side", TOKENIZERS)
def test_the_tasks_are_not_trivial(parity: dict, side: str) -> None:
    run = parity[side]
    metrics, hf = run["metrics"], run["tokenizer"].hf_tokenizer
    assert metrics["lm_eval/parity_mc/acc"] < 0.8  # distractors the model often prefers
    greedy = [r[1] for r in reference_responses(run["reference"]["parity_last_word"]["requests"])]
    assert 3 <= sum(greedy) < len(greedy)
    mc_requests = run["reference"]["parity_mc"]["requests"]
    contexts = [len(hf.encode(args[0])) for r in mc_requests for args in r["arguments"]]
    assert max(contexts) > MAX_SEQ_LEN  # left truncation happened
    assert any(args[0] == "" for r in run["reference"]["parity_last_word"]["requests"]
               for args in r["arguments"])  # fmt: skip
    documents = [r["arguments"][0][0] for r in run["reference"]["parity_rolling"]["requests"]]
    assert min(len(hf.encode(doc)) for doc in documents) > 2 * MAX_SEQ_LEN  # several windows
