"""How a cache's documents become ids, and for chats and prompt/answer pairs, a loss mask.

A cache's `format` (kiln_contract.tokenize.DOCUMENT_FORMATS) picks the encoder:

  - "text": the text field, framed by the cache's `framing` (kiln.data.tokenizer, .framing).
  - "chat": a `messages` list of {role, content}, rendered by the chat template (the BUILD
    file's, else the tokenizer's) as transformers' `apply_chat_template(messages, tokenize=True,
    return_dict=True, return_assistant_tokens_mask=True)` renders it: the ids are the template's
    text, tokenized once with special tokens' text matched; the mask is 1 at every token that
    the template's `{% generation %}` ... `{% endgeneration %}` blocks mark (Levanter's
    ChatProcessor takes the same ids and `assistant_masks`). No BOS or EOS is added: the
    template writes what the model sees.
  - "supervised": a prompt (`input_key`) and its answer (`target_key`): the chat [user: prompt,
    assistant: answer] rendered by SUPERVISED_TEMPLATE as a chat is, so BOS (Kiln's rule) +
    prompt + answer + EOS, the whole text tokenized once; the mask is 1 at the answer's tokens
    and the EOS, a token that straddles prompt and answer included (as transformers marks it).

A bad document is a SourceError naming its origin (file:line) and what to do.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain
from typing import Any, Protocol

import numpy as np

from kiln.data.document import Document, DocumentKeys
from kiln.data.errors import SourceError, SpecError
from kiln.data.tokenizer import EncodedDocuments, LoadedTokenizer
from kiln_contract.tokenize import CacheSpec

# The roles of chat messages: those of transformers' and Levanter's chat data.
ROLES = ("system", "user", "assistant", "tool")
ASSISTANT = "assistant"
# A prompt/answer pair as a chat template: the prompt (the first message) and, in the generation
# block, the answer and EOS; BOS_TEMPLATE goes first when the tokenizer has a BOS by Kiln's rule.
SUPERVISED_TEMPLATE = (
    "{{ messages[0]['content'] }}"
    "{% generation %}{{ messages[1]['content'] }}{{ eos_token }}{% endgeneration %}"
)
BOS_TEMPLATE = "{{ bos_token }}"


class DocumentEncoder(Protocol):
    """Encodes one format's documents; `keys` say which fields of a record they are read from."""

    @property
    def keys(self) -> DocumentKeys: ...

    def encode(self, documents: Sequence[Document]) -> EncodedDocuments: ...

    def text_bytes(self, documents: Sequence[Document]) -> int:
        """The UTF-8 bytes of the documents' own text (stats.json's `text_bytes`)."""
        ...


def document_encoder(spec: CacheSpec, tokenizer: LoadedTokenizer) -> DocumentEncoder:
    if spec.format == "chat":
        return ChatEncoder(tokenizer, spec.messages_key, spec.chat_template)
    if spec.format == "supervised":
        return SupervisedEncoder(tokenizer, spec.input_key, spec.target_key)
    return TextEncoder(tokenizer, spec.text_key, spec.framing)


class TextEncoder:
    def __init__(self, tokenizer: LoadedTokenizer, text_key: str, framing: str) -> None:
        self.keys: DocumentKeys = text_key
        self._tokenizer = tokenizer
        self._framing = framing

    def encode(self, documents: Sequence[Document]) -> EncodedDocuments:
        return self._tokenizer.encode_documents([d.text for d in documents], self._framing)

    def text_bytes(self, documents: Sequence[Document]) -> int:
        return sum(len(d.text.encode("utf-8")) for d in documents)


class ChatEncoder:
    def __init__(
        self, tokenizer: LoadedTokenizer, messages_key: str, chat_template: str | None
    ) -> None:
        self.keys: DocumentKeys = (messages_key,)
        self._tokenizer = tokenizer
        self._messages_key = messages_key
        self._template = chat_template or tokenizer.hf_tokenizer.chat_template
        if not isinstance(self._template, str):
            raise SpecError(
                f"the tokenizer {tokenizer.info.name!r} has no chat template: give the "
                "tokenized_cache a `chat_template` (a Jinja template with {% generation %} "
                "blocks around the assistant's turns)."
            )
        if not has_generation_block(self._template):
            raise SpecError(
                "the chat template has no {% generation %} block, so no token would count in "
                "the loss: wrap each assistant turn's content (and its end-of-turn token) in "
                "{% generation %} ... {% endgeneration %}, or give a `chat_template` that does."
            )

    def encode(self, documents: Sequence[Document]) -> EncodedDocuments:
        chats = [checked_messages(d.fields[self._messages_key], d.origin) for d in documents]
        return rendered_chats(self._tokenizer, self._template, chats, documents)

    def text_bytes(self, documents: Sequence[Document]) -> int:
        return sum(
            len(str(message.get("content", "")).encode("utf-8"))
            for document in documents
            for message in document.fields[self._messages_key]
        )


def rendered_chats(
    tokenizer: LoadedTokenizer,
    template: str,
    chats: list[list[dict[str, Any]]],
    documents: Sequence[Document],
    **template_values: str,
) -> EncodedDocuments:
    """The chats' ids and loss masks as transformers' `apply_chat_template(...,
    return_assistant_tokens_mask=True)` gives them, the documents' (their origins name a bad
    one); `template_values` (`eos_token=...`) replace the tokenizer's special tokens' text."""
    if not chats:
        return _concatenated([], [])
    try:
        rendered = _applied_template(tokenizer, template, chats, template_values)
    except SourceError:  # one document's: rendered alone, it names itself
        for chat, document in zip(chats, documents):
            _applied_template(tokenizer, template, [chat], template_values, document.origin)
        raise
    for mask, document in zip(rendered["assistant_masks"], documents):
        if not any(mask):
            raise SourceError(
                f"{document.origin}: the chat's assistant turns render to no tokens inside the "
                "template's {% generation %} blocks (empty content, or a template that leaves "
                "it out), so nothing in it counts in the loss: fill in or drop the document."
            )
    return _concatenated(rendered["input_ids"], rendered["assistant_masks"])


def _applied_template(
    tokenizer: LoadedTokenizer,
    template: str,
    chats: list[list[dict[str, Any]]],
    template_values: dict[str, str],
    origin: str = "a document",
) -> Any:
    import jinja2

    with tokenizer.templating() as hf_tokenizer:
        try:
            return hf_tokenizer.apply_chat_template(
                chats,
                chat_template=template,
                tokenize=True,
                return_dict=True,
                return_assistant_tokens_mask=True,
                **template_values,
            )
        except jinja2.TemplateError as e:
            raise SourceError(
                f"{origin}: the chat template cannot render this chat ({e}); fix "
                "the document or the template."
            ) from None


def checked_messages(messages: Any, origin: str) -> list[dict[str, Any]]:
    """A chat's messages: a list of {role, content} objects, roles known, one of them the
    assistant's (a chat whose loss counts no token teaches nothing)."""
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise SourceError(
            f"{origin}: a chat's messages must be a list of {{role, content}} objects, got "
            f"{type(messages).__name__}."
        )
    for number, message in enumerate(messages):
        role = message.get("role")
        if role not in ROLES:
            raise SourceError(
                f"{origin}: message {number} has role {role!r}; a chat's roles are "
                f"{', '.join(ROLES)}: rename it or drop the message."
            )
        if not isinstance(message.get("content"), str):
            raise SourceError(
                f"{origin}: message {number} ({role}) needs a string `content`, got "
                f"{type(message.get('content')).__name__}."
            )
    if not any(message["role"] == ASSISTANT for message in messages):
        raise SourceError(
            f"{origin}: the chat has no assistant turn, and only assistant tokens count in the "
            "loss: add the assistant's reply or drop the document."
        )
    return messages


def has_generation_block(template: str) -> bool:
    """Whether a Jinja template holds a `{% generation %}` block tag (whatever its whitespace
    control, `{%- generation %}`), found by Jinja's own lexer rather than a pattern."""
    import jinja2

    lexed = jinja2.Environment().lex(template)
    tokens = [(kind, value) for _, kind, value in lexed if kind != "whitespace"]
    return any(
        before[0] == "block_begin" and token == ("name", "generation")
        for before, token in zip(tokens, tokens[1:])
    )


class SupervisedEncoder:
    def __init__(self, tokenizer: LoadedTokenizer, input_key: str, target_key: str) -> None:
        self.keys: DocumentKeys = (input_key, target_key)
        self._input_key = input_key
        self._target_key = target_key
        self._tokenizer = tokenizer
        self._template = supervised_template(tokenizer)
        # Kiln's EOS, also for a tokenizer whose config names none (kiln.data.tokenizer).
        self._eos_token = tokenizer.hf_tokenizer.convert_ids_to_tokens(tokenizer.info.eos_id)

    def encode(self, documents: Sequence[Document]) -> EncodedDocuments:
        chats = [
            [{"role": "user", "content": prompt}, {"role": ASSISTANT, "content": answer}]
            for prompt, answer in zip(*self._texts(documents))
        ]
        return rendered_chats(
            self._tokenizer, self._template, chats, documents, eos_token=self._eos_token
        )

    def text_bytes(self, documents: Sequence[Document]) -> int:
        return sum(len(text.encode("utf-8")) for texts in self._texts(documents) for text in texts)

    def _texts(self, documents: Sequence[Document]) -> tuple[list[str], list[str]]:
        prompts = [_string_field(d, self._input_key) for d in documents]
        answers = [_string_field(d, self._target_key) for d in documents]
        for document, answer in zip(documents, answers):
            if not answer.strip():
                raise SourceError(
                    f"{document.origin}: the answer (field {self._target_key!r}) is empty, and only "
                    "the answer counts in the loss: fill it in or drop the document."
                )
        return prompts, answers


def supervised_template(tokenizer: LoadedTokenizer) -> str:
    """The chat template a prompt/answer pair is rendered by: BOS first when the tokenizer has
    one by Kiln's rule (kiln.data.tokenizer), which a chat template's `bos_token` does not know."""
    if tokenizer.info.bos_id is None:
        return SUPERVISED_TEMPLATE
    return BOS_TEMPLATE + SUPERVISED_TEMPLATE


def _string_field(document: Document, key: str) -> str:
    value = document.fields[key]
    if not isinstance(value, str):
        raise SourceError(
            f"{document.origin}: field {key!r} must be a string, got {type(value).__name__}."
        )
    return value


def _concatenated(ids: list[list[int]], masks: list[list[int]]) -> EncodedDocuments:
    lengths = np.fromiter(map(len, ids), np.int64, count=len(ids))
    total = int(lengths.sum())
    return EncodedDocuments(
        tokens=np.fromiter(chain.from_iterable(ids), np.uint32, count=total),
        lengths=lengths,
        masks=np.fromiter(chain.from_iterable(masks), np.uint8, count=total),
    )
