"""The Hugging Face settings the Pants backend hands a tokenize process out of band (the user's
HF_TOKEN, HF_HOME, endpoint and offline switches; kiln_pants.hub_settings): read from the mounted
named cache into the environment before anything imports huggingface_hub, which reads some of
them once at import. Variables already set in the environment win."""

from __future__ import annotations

import json
import os
from pathlib import Path

from kiln_contract.tokenize import HUB_SETTINGS_DIR, HUB_SETTINGS_FILE, HUB_VARIABLES

SETTINGS_PATH = Path(HUB_SETTINGS_DIR) / HUB_SETTINGS_FILE


def apply_hub_settings(path: Path = SETTINGS_PATH) -> list[str]:
    """Sets the known variables the file holds and the environment lacks; returns their names
    (never their values: a token is no log line)."""
    try:
        values = json.loads(path.read_text())
    except FileNotFoundError:
        return []
    except (OSError, ValueError):  # unreadable or torn: the hub is then used without them
        return []
    applied = []
    for name in HUB_VARIABLES:
        value = values.get(name) if isinstance(values, dict) else None
        if isinstance(value, str) and value and name not in os.environ:
            os.environ[name] = value
            applied.append(name)
    return applied
