"""The contract between Kiln's two halves: the specs the Pants backend writes and the runtime reads.

The backend (CPython 3.9, inside Pants) builds these frozen dataclasses from BUILD files and
writes them as JSON (`to_json()`); the runtime (CPython 3.12) parses that JSON once at its
boundary (`from_json()`) and works with the objects. Each vocabulary, schema and rule the two
halves share is defined here, once. The package uses the standard library only, with CPython
3.9's syntax, and imports nothing at package level. docs/step-spec.md describes the formats.
"""
