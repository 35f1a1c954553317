"""The cluster's expected failure: its own module, so that what runs on the cluster (dispatch,
placement) raises it without importing the client's connection code."""

from __future__ import annotations


class ClusterError(RuntimeError):
    """An expected failure talking to the cluster (one paragraph, no traceback)."""
