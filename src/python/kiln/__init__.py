"""Kiln's runtime: runs inside Pants processes on CPython 3.12 (tokenize, train, evaluate)."""
