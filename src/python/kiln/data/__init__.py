"""Datasets for Kiln: sources, tokenizers, the sharded TensorStore token cache and its reader.

Build a cache with `python -m kiln.data.tokenize` (see docs/token-cache.md); read one with
`kiln.data.cache.TokenCache`.
"""
