"""The tokenize spec as kiln.data reads it: the contract's types (kiln_contract.tokenize), parsed
once, with a bad field reported as kiln.data's SpecError (one paragraph, no traceback).
"""

from __future__ import annotations

from typing import Any

import kiln_contract.parsing
from kiln.data.errors import SpecError
from kiln_contract.tokenize import CacheSpec, TokenizerSpec


def parse_cache_spec(obj: Any) -> CacheSpec:
    try:
        return CacheSpec.from_json(obj)
    except kiln_contract.parsing.SpecError as e:
        raise SpecError(str(e)) from None


def parse_tokenizer_spec(obj: Any, where: str = "tokenizer") -> TokenizerSpec:
    try:
        return TokenizerSpec.from_json(obj, where)
    except kiln_contract.parsing.SpecError as e:
        raise SpecError(str(e)) from None
