"""End to end: small caches, the shape of a data-ablation study's thousands, through real
./pants in the e2e tests' workspace (conftest.py). `build` tokenizes them many to a process, yet
each is its own artifact: a store cache whose file is bad fails alone, the others are built with
the documents of their own files; fixed, only that cache is tokenized again; `plan` then says
what `build` did. Inline caches go in their directory's batch, which Pants' cache serves to any
goal asking for one of them. A chat cache among them is built the same way, its loss mask what
transformers' `apply_chat_template` marks.
"""

from __future__ import annotations

import json
import os
import re
import uuid
from pathlib import Path
from typing import Any

from kiln.data.cache import TokenCache
from kiln.data.tokenizer import load_tokenizer
from tests.e2e.workspace import run_pants

VERSION = "2026.12.03"
CACHE = """
tokenized_cache(
    name="c{i}",
    artifact_name="tokenized/many/c{i}",
    sources=["texts/c{i}.jsonl"],
    tokenizer="//experiments/tokenizers:kiln-stdlib-8k",
    version="{version}",
    storage="store",
)
"""
INLINE_CACHE = """
tokenized_cache(
    name="i{i}",
    artifact_name="tokenized/many/i{i}",
    sources=["texts/i{i}.jsonl"],
    tokenizer="//experiments/tokenizers:kiln-stdlib-8k",
    version="{version}",
)
"""
# A chat cache: the tokenizer has no chat template, so the BUILD file gives one.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {% if m['role'] == 'assistant' %}{% generation %}"
    "{{ m['content'] }}{{ eos_token }}{% endgeneration %}{% else %}{{ m['content'] }}{% endif %}"
    "\n{% endfor %}"
)
CHAT_CACHE = f"""
tokenized_cache(
    name="chat",
    artifact_name="tokenized/many/chat",
    sources=["texts/chat.jsonl"],
    tokenizer="//experiments/tokenizers:kiln-stdlib-8k",
    version="{VERSION}",
    storage="store",
    format="chat",
    chat_template={CHAT_TEMPLATE!r},
)
"""
CHATS = [
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, how can I?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a prime."},
     {"role": "assistant", "content": "7"}, {"role": "user", "content": "Another?"},
     {"role": "assistant", "content": "11 ✓"}],
]  # fmt: skip
CACHES = 4
BAD = 2  # its file has no "text" field
INLINE = 2


# This machine's Pants cache may hold an earlier run's inline batch: texts of this run alone.
RUN = uuid.uuid4().hex[:8]


def _texts(i: int) -> list[str]:
    return [f"Document {j} of cache {i} ({RUN}): {'word ' * (i + j)}".strip() for j in range(3)]


def _write_files(folder: Path, bad: int | None) -> None:
    texts = folder / "texts"
    texts.mkdir(parents=True, exist_ok=True)
    for i in range(CACHES):
        key = "body" if i == bad else "text"
        lines = [json.dumps({key: text}) for text in _texts(i)]
        (texts / f"c{i}.jsonl").write_text("\n".join(lines) + "\n")
    for i in range(INLINE):
        lines = [json.dumps({"text": text}) for text in _texts(10 + i)]
        (texts / f"i{i}.jsonl").write_text("\n".join(lines) + "\n")
    (texts / "chat.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in CHATS))


def _decoded(cache_folder: Path, tokenizer: Any) -> list[str]:
    cache = TokenCache.open(cache_folder)
    documents = [cache.document(j) for j in range(cache.num_documents)]
    decoded = [tokenizer.hf_tokenizer.decode(d, skip_special_tokens=True) for d in documents]
    return [text.strip() for text in decoded]


def _check_chat_cache(cache_folder: Path, tokenizer: Any) -> None:
    """Ids and loss mask, chat for chat, as transformers renders the BUILD file's template."""
    cache = TokenCache.open(cache_folder)
    assert cache.num_documents == len(CHATS)
    for i, chat in enumerate(CHATS):
        rendered = tokenizer.hf_tokenizer.apply_chat_template(
            chat, chat_template=CHAT_TEMPLATE, tokenize=True, return_dict=True,
            return_assistant_tokens_mask=True,
        )  # fmt: skip
        assert cache.document(i).tolist() == list(rendered["input_ids"])
        assert cache.document_mask(i).tolist() == list(rendered["assistant_masks"])


def test_small_caches_build_many_to_a_process_and_fail_alone(workspace: Path) -> None:
    repo = workspace
    folder = repo / "experiments/many"
    _write_files(folder, bad=BAD)
    (folder / "BUILD").write_text(
        "".join(CACHE.format(i=i, version=VERSION) for i in range(CACHES))
        + "".join(INLINE_CACHE.format(i=i, version=VERSION) for i in range(INLINE))
        + CHAT_CACHE
    )
    env = dict(os.environ)

    first = run_pants(repo, "build", "experiments/many:", env=env, check=False)
    assert first.returncode == 1, first.stderr[-4000:]
    # One process tokenized all four and the chat cache; the bad one failed alone, naming its file.
    batch = f"Tokenizing {CACHES + 1} small cache(s), tokenized/many/c0@{VERSION} to "
    assert batch in first.stderr
    # The inline ones in one process of their own.
    assert f"Tokenizing {INLINE} small cache(s), tokenized/many/i0@{VERSION} to " in first.stderr
    summary = {name: status for status, name in re.findall(
        r"^(SUCCESS|FAILED)\s+tokenized/many/([ci]\d|chat)@", first.stderr, re.M)}  # fmt: skip
    assert summary == {
        **{f"c{i}": "FAILED" if i == BAD else "SUCCESS" for i in range(CACHES)},
        **{f"i{i}": "SUCCESS" for i in range(INLINE)},
        "chat": "SUCCESS",
    }
    assert f"experiments/many/texts/c{BAD}.jsonl:1: no field 'text'" in first.stderr

    store = repo / "artifacts/tokenized/many"
    tokenizer = load_tokenizer(
        {"kind": "local", "path": str(repo / "experiments/tokenizers/kiln-stdlib-8k")}
    )
    for i in range(CACHES):
        if i == BAD:  # STATUS FAILED and its reason: what `plan` shows
            assert (store / f"c{i}/{VERSION}/STATUS").read_text().strip() == "FAILED"
            assert "no field 'text'" in (store / f"c{i}/{VERSION}/failure.txt").read_text()
            continue
        assert _decoded(store / f"c{i}/{VERSION}", tokenizer) == _texts(i)
        record = json.loads((store / f"c{i}/{VERSION}/artifact.json").read_text())
        assert record["name"] == f"tokenized/many/c{i}"  # its own record, its own fingerprint
    _check_chat_cache(store / f"chat/{VERSION}", tokenizer)

    _write_files(folder, bad=None)
    second = run_pants(repo, "build", "experiments/many:", env=env)
    assert f"Tokenizing 1 small cache(s), tokenized/many/c{BAD}@{VERSION} to " in second.stderr
    # The other store caches, the chat cache and the inline batch (Pants' cache): one summary
    # line, none each; the one rebuilt alone in its batch reports its own time.
    assert f"SERVED      {CACHES - 1 + 1 + INLINE} cache(s), built before" in second.stderr
    assert "kiln: served" not in second.stderr and "kiln: start" not in second.stderr
    assert re.search(rf"kiln: success +tokenized/many/c{BAD}@{VERSION} in \d", second.stderr)
    assert not list(store.glob(f"*/.{VERSION}.shards"))  # each cache's shard moved into it
    assert (store / f"c{BAD}/{VERSION}/STATUS").read_text().strip() == "SUCCESS"
    assert not (store / f"c{BAD}/{VERSION}/failure.txt").exists()  # the reason went with it
    assert "tokenized/many/i0" not in "".join(  # the inline batch: served by Pants' cache
        line for line in second.stderr.splitlines() if "Tokenizing" in line
    )

    # One inline cache asked for alone: the same batch, served; its own documents.
    packaged = run_pants(repo, "package", "experiments/many:i1", env=env)
    assert "Tokenizing" not in packaged.stderr, packaged.stderr[-2000:]
    assert _decoded(repo / f"dist/tokenized/many/i1/{VERSION}", tokenizer) == _texts(11)

    planned = run_pants(repo, "plan", "experiments/many:", env=env)
    built = re.findall(r"^\s+built\s+\w+\s+tokenized_cache\s+tokenized/many/(c\d)@",
                       planned.stdout, re.M)  # fmt: skip
    assert sorted(built) == [f"c{i}" for i in range(CACHES)], planned.stdout
    inline = re.findall(r"^\s+inline\s+\w+\s+tokenized_cache\s+tokenized/many/(i\d)@",
                        planned.stdout, re.M)  # fmt: skip
    assert sorted(inline) == [f"i{i}" for i in range(INLINE)], planned.stdout
