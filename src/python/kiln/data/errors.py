"""The errors kiln.data raises for bad input: printed as one paragraph, without a traceback."""


class KilnDataError(Exception):
    """An expected failure caused by the user's input (spec, files, tokenizer, cache)."""


class SpecError(KilnDataError):
    """The step spec JSON is malformed: the message names the field."""


class SourceError(KilnDataError):
    """A source cannot be read: the message names the file (and line) or the dataset id."""


class TokenizerError(KilnDataError):
    """A tokenizer cannot be loaded: the message names it and what to do."""


class CacheError(KilnDataError):
    """A cache or shard folder is incomplete or inconsistent: the message names the folder."""


class CacheDamaged(CacheError):
    """A finished cache's content is not what was written (a missing, truncated or altered
    file, token ids beyond the vocabulary, inconsistent offsets): the message names the cache,
    the shard and the file."""
