"""Chat and supervised caches: their ids and loss masks, document for document, equal what
transformers' `apply_chat_template(..., return_assistant_tokens_mask=True)` and Levanter's own
ChatProcessor (levanter_writer.py, from PyPI) give, a prompt/answer pair as the chat [user:
prompt, assistant: answer] under Kiln's supervised template; Levanter's reader reads Kiln's
shard; bad documents fail in one line naming the file and line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from kiln_testing.data import STDLIB_TOKENIZER, bos_tokenizer_folder, make_spec
from kiln_testing.levanter import write_levanter_caches

from kiln.data.cache import TokenCache
from kiln.data.document_formats import supervised_template
from kiln.data.errors import CacheError, SourceError, SpecError
from kiln.data.mixture import window_loss_mask
from kiln.data.tokenize import build_cache, main
from kiln.data.tokenizer import load_tokenizer
from kiln.report.run_summary import sample_prompts

# Trims each turn's content and its own whitespace ({%- -%}); the assistant's turn and its EOS
# are the generation block.
TRIMMING = (
    "{%- for m in messages -%}"
    "{{ '<|' + m['role'] + '|>\\n' }}"
    "{%- if m['role'] == 'assistant' -%}"
    "{% generation %}{{ m['content'] | trim }}{{ eos_token }}{% endgeneration %}"
    "{%- else -%}{{ m['content'] | trim }}{%- endif -%}"
    "{{ '\\n' }}"
    "{%- endfor -%}"
)
# Keeps every character; the generation block opens mid-line, so BPE merges may cross it.
VERBATIM = (
    "{% for m in messages %}{{ m['role'] }}: "
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}{{ eos_token }}"
    "{% endgeneration %}{% else %}{{ m['content'] }}{% endif %}\n{% endfor %}"
)
TEMPLATES = {"trimming": TRIMMING, "verbatim": VERBATIM}


def turn(role: str, content: str) -> dict[str, str]:
    return {"role": role, "content": content}


CHATS = [
    [turn("user", "What is a token cache?"), turn("assistant", "Token ids, stored by shard.")],
    [turn("system", "Answer briefly."), turn("user", "Hi  there"), turn("assistant", "  Hello!  ")],
    [turn("user", ""), turn("assistant", "You said nothing."), turn("user", "ünïcödé ✓ 日本"),
     turn("assistant", "Ça va — ✓")],
    [turn("user", "Say <|endoftext|> please."), turn("assistant", "<|endoftext|>"),
     turn("user", "\n\n"), turn("assistant", "\tDone.\n")],
]  # fmt: skip
# Prompt/answer pairs with awkward edges: a prompt ending mid-word (a BPE merge straddles prompt
# and answer), an empty prompt, unicode, whitespace at both edges, the EOS's text in the answer.
PAIRS = [
    ("2 + 2 =", " 4"),
    ("The tok", "enizer splits it."),
    ("", "ünïcödé ✓ 日本"),
    ("  Hello \n", "\n  world  "),
    ("Say the end:", " <|endoftext|> and more"),
]
STRADDLING, WITH_EOS_TEXT = 1, 4  # PAIRS' rows


def write_chats(path: Path, chats: list[list[dict[str, str]]], key: str = "messages") -> Path:
    path.write_text("".join(json.dumps({key: chat}) + "\n" for chat in chats))
    return path


def chat_cache(folder: Path, template: str, chats: list = CHATS, **config: Any) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    source = {"kind": "files", "paths": [str(write_chats(folder / "chats.jsonl", chats))]}
    spec = make_spec(source, format="chat", chat_template=template, **config)
    return build_cache(spec, folder / "cache")


def pair_chat(prompt: str, answer: str) -> list[dict[str, str]]:
    """A prompt/answer pair as the chat Kiln's supervised template renders."""
    return [turn("user", prompt), turn("assistant", answer)]


def supervised_cache(folder: Path, tokenizer: dict[str, str]) -> Path:
    """A supervised cache of PAIRS, and beside its qa.jsonl the equivalent chats.jsonl."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "qa.jsonl"
    path.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in PAIRS))
    write_chats(folder / "chats.jsonl", [pair_chat(*pair) for pair in PAIRS])
    spec = make_spec({"kind": "files", "paths": [str(path)]}, format="supervised",
                     input_key="question", target_key="answer", tokenizer=tokenizer)  # fmt: skip
    return build_cache(spec, folder / "cache")


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, str]]:
    """The quickstart's tokenizer (no BOS) and the same with a BOS its post-processor adds."""
    bos = bos_tokenizer_folder(tmp_path_factory.mktemp("bos") / "tokenizer")
    return {"no-bos": STDLIB_TOKENIZER, "bos": {"kind": "local", "path": str(bos)}}


def rows(cache: TokenCache) -> list[tuple[list[int], list[int]]]:
    return [
        (cache.document(i).tolist(), cache.document_mask(i).tolist())
        for i in range(cache.num_documents)
    ]


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_chat_cache_equals_transformers_apply_chat_template(tmp_path: Path, name: str) -> None:
    from transformers import AutoTokenizer

    cache = TokenCache.open(chat_cache(tmp_path, TEMPLATES[name]))
    reference = AutoTokenizer.from_pretrained(STDLIB_TOKENIZER["path"])  # its own, fresh
    expected = []
    for chat in CHATS:
        rendered = reference.apply_chat_template(
            chat, chat_template=TEMPLATES[name], tokenize=True, return_dict=True,
            return_assistant_tokens_mask=True,
        )  # fmt: skip
        expected.append((list(rendered["input_ids"]), list(rendered["assistant_masks"])))
    assert cache.masked and cache.info["format"] == "chat"
    assert rows(cache) == expected
    assert cache.document(3).tolist().count(0) >= 2  # the template's EOS and "<|endoftext|>"


def test_caches_equal_levanters_chat_processor_and_levanter_reads_them(
    tmp_path: Path, tokenizers: dict[str, dict[str, str]]
) -> None:
    """Levanter's ChatProcessor on the same chats and template gives the same ids and
    `assistant_masks`, and on a supervised cache's pairs as chats under Kiln's supervised
    template; Levanter's JaggedArrayStore reads Kiln's shard (ids and mask) back."""
    jobs, caches = [], {}
    for name, template in TEMPLATES.items():
        caches[name] = TokenCache.open(chat_cache(tmp_path / name, template))
        jobs.append(levanter_job(tmp_path / name, STDLIB_TOKENIZER, template, caches[name]))
    for side, tokenizer in tokenizers.items():
        name = f"supervised-{side}"
        caches[name] = TokenCache.open(supervised_cache(tmp_path / name, tokenizer))
        template = supervised_template(load_tokenizer(tokenizer))
        jobs.append(levanter_job(tmp_path / name, tokenizer, template, caches[name]))
    write_levanter_caches(jobs, tmp_path)
    for name, cache in caches.items():
        for side in ("levanter", "kiln"):
            assert read_rows(tmp_path / name / f"levanter.{side}.npz") == rows(cache), (name, side)


def levanter_job(
    folder: Path, tokenizer: dict[str, str], template: str, cache: TokenCache
) -> dict[str, str]:
    """A levanter_writer.py chat job: ChatProcessor over folder/chats.jsonl, and Levanter's
    reader over the cache's shard."""
    return {
        "kind": "chat", "docs": str(folder / "chats.jsonl"), "tokenizer": tokenizer["path"],
        "chat_template": template, "kiln_shard": str(cache.path / "shards/shard-00000"),
        "out": str(folder / "levanter"),
    }  # fmt: skip


def read_rows(path: Path) -> list[tuple[list[int], list[int]]]:
    read = np.load(path)
    cuts = np.cumsum(read["lengths"])[:-1]
    ids, masks = np.split(read["input_ids"], cuts), np.split(read["assistant_masks"], cuts)
    return [(i.tolist(), m.tolist()) for i, m in zip(ids, masks)]


def test_windows_carry_the_mask_beside_the_tokens(tmp_path: Path) -> None:
    cache = TokenCache.open(chat_cache(tmp_path, TRIMMING))
    stream = np.concatenate([cache.document_mask(i) for i in range(cache.num_documents)])
    seq_len = 16
    batch = cache.windows(list(range(cache.num_windows(seq_len))), seq_len)
    assert batch.assistant_masks is not None and batch.assistant_masks.dtype == np.uint8
    assert batch.assistant_masks.ravel().tolist() == stream[: batch.tokens.size].tolist()
    # The loss counts tokens[t] -> tokens[t+1] where t+1 is masked in, within one document.
    same_document = batch.segment_ids[:, 1:] == batch.segment_ids[:, :-1]
    expected = same_document & (batch.assistant_masks[:, 1:] == 1)
    assert (batch.loss_mask[:, :-1] == expected).all() and not batch.loss_mask[:, -1].any()
    assert 0 < batch.loss_mask.sum() < same_document.sum()
    # Levanter's causal mask (every position) still counts only the masked-in tokens.
    causal = window_loss_mask(batch, "all")
    assert (causal[:, :-1] == (batch.assistant_masks[:, 1:] == 1)).all()


def test_sample_prompts_of_a_chat_cache_end_where_the_answer_starts(tmp_path: Path) -> None:
    cache = TokenCache.open(chat_cache(tmp_path, TRIMMING))
    prompts = sample_prompts(cache, max_length=32)
    for row, prompt in enumerate(prompts):
        ids, mask = cache.document(row), cache.document_mask(row)
        start = int(np.argmax(mask))  # the first token the assistant writes
        assert prompt.tolist() == ids[start - len(prompt) : start].tolist()


@pytest.mark.parametrize("side", ["no-bos", "bos"])
def test_supervised_cache_equals_transformers_on_the_pairs_chats(
    tmp_path: Path, tokenizers: dict[str, dict[str, str]], side: str
) -> None:
    """BOS (Kiln's rule) + prompt + answer + EOS, tokenized whole; the mask on the answer and the
    EOS, a token straddling prompt and answer included, as transformers marks it."""
    from transformers import AutoTokenizer

    cache = TokenCache.open(supervised_cache(tmp_path, tokenizers[side]))
    kiln = load_tokenizer(tokenizers[side])
    reference = AutoTokenizer.from_pretrained(tokenizers[side]["path"])  # its own, fresh
    expected = []
    for pair in PAIRS:
        rendered = reference.apply_chat_template(
            pair_chat(*pair), chat_template=supervised_template(kiln), tokenize=True,
            return_dict=True, return_assistant_tokens_mask=True,
        )  # fmt: skip
        expected.append((list(rendered["input_ids"]), list(rendered["assistant_masks"])))
    assert rows(cache) == expected
    assert cache.info["format"] == "supervised" and "text_key" not in cache.info
    bos, eos = [] if kiln.info.bos_id is None else [kiln.info.bos_id], kiln.info.eos_id
    assert bool(bos) == (side == "bos")
    for (ids, mask), (prompt, answer) in zip(rows(cache), PAIRS):
        start = mask.index(1)  # the answer's first token, perhaps straddling
        assert ids[: len(bos)] == bos and ids[-1] == eos and mask[: len(bos)] == [0] * len(bos)
        assert mask[start:] == [1] * (len(ids) - start)
        assert kiln.decode(ids[len(bos) : -1]) == prompt + answer
        assert prompt.startswith(kiln.decode(ids[len(bos) : start]))
        assert kiln.decode(ids[start:-1]).endswith(answer)
    ids, mask = rows(cache)[STRADDLING]
    separately = [*bos, *kiln.encode(PAIRS[STRADDLING][0]), *kiln.encode(PAIRS[STRADDLING][1]), eos]
    assert ids != separately  # " tokenizer" is one token, its "enizer" the answer's
    assert kiln.decode([ids[mask.index(1)]]) == " tokenizer"
    assert rows(cache)[WITH_EOS_TEXT][0].count(eos) == 2  # the answer's "<|endoftext|>" too


def test_a_text_cache_has_no_mask(tmp_path: Path) -> None:
    path = tmp_path / "docs.jsonl"
    path.write_text(json.dumps({"text": "plain text"}) + "\n")
    cache = TokenCache.open(build_cache(make_spec({"kind": "files", "paths": [str(path)]}),
                                        tmp_path / "cache"))  # fmt: skip
    assert not cache.masked and cache.windows([0], 2).assistant_masks is None
    assert "format" not in cache.info
    with pytest.raises(CacheError, match="is a text cache: it stores no loss mask"):
        cache.document_mask(0)


@pytest.mark.parametrize(
    "chat, message",
    [
        ([turn("user", "hello")], r"chats.jsonl:2: the chat has no assistant turn"),
        ([turn("human", "hi"), turn("assistant", "hi")],
         r"chats.jsonl:2: message 0 has role 'human'; a chat's roles are system, user"),
    ],
)  # fmt: skip
def test_bad_chats_name_the_file_and_line(tmp_path: Path, chat: list, message: str) -> None:
    with pytest.raises(SourceError, match=message):
        chat_cache(tmp_path, TRIMMING, chats=[CHATS[0], chat])


def test_an_over_long_chat_is_refused_by_max_document_chars(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match=r"chats.jsonl:1: the document has \d+ characters, more "
                       r"than max_document_chars=20"):  # fmt: skip
        chat_cache(tmp_path, TRIMMING, max_document_chars=20)


def test_a_chat_whose_mask_is_empty_is_refused(tmp_path: Path) -> None:
    """A template whose generation blocks mark no token of a chat (here: only a role the chat
    does not have) would teach nothing."""
    template = TRIMMING.replace("m['role'] == 'assistant'", "m['role'] == 'tool'")
    with pytest.raises(SourceError, match=r"chats.jsonl:1: the chat's assistant turns render"):
        chat_cache(tmp_path, template)


def test_a_chat_the_template_refuses_names_its_line(tmp_path: Path) -> None:
    """Chats render in batches; the one the template refuses is named alone."""
    refusing = (
        "{% if messages[0]['content'] == 'refuse' %}{{ raise_exception('no, thanks') }}"
        "{% endif %}" + TRIMMING
    )
    refused = [turn("user", "refuse"), turn("assistant", "ok")]
    with pytest.raises(SourceError, match=r"chats.jsonl:2: the chat template cannot render this "
                       r"chat \(no, thanks\)"):  # fmt: skip
        chat_cache(tmp_path, refusing, chats=[CHATS[0], refused, CHATS[1]])


def test_a_template_without_generation_blocks_is_refused(tmp_path: Path) -> None:
    plain = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(SpecError, match=r"the chat template has no \{% generation %\} block"):
        chat_cache(tmp_path, plain)


def test_missing_supervised_field_is_one_line_naming_the_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    Path("qa.jsonl").write_text('{"input": "a", "target": "b"}\n{"input": "c"}\n')
    spec = make_spec({"kind": "files", "paths": ["qa.jsonl"]}, format="supervised")
    Path("spec.json").write_text(json.dumps(spec))
    assert main(["build", "spec.json", "--out", "cache"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: qa.jsonl:2: no field 'target' (the format's keys: input, target)")


@pytest.mark.parametrize("answer", ["", " \n "])
def test_an_empty_answer_is_refused_naming_the_line(tmp_path: Path, answer: str) -> None:
    path = tmp_path / "qa.jsonl"
    path.write_text(json.dumps({"input": "a", "target": "b"}) + "\n"
                    + json.dumps({"input": "c", "target": answer}) + "\n")  # fmt: skip
    spec = make_spec({"kind": "files", "paths": [str(path)]}, format="supervised")
    with pytest.raises(SourceError, match=r"qa.jsonl:2: the answer \(field 'target'\) is empty"):
        build_cache(spec, tmp_path / "cache")
