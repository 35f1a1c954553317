"""The Hugging Face settings the Pants backend hands a tokenize process out of band (the user's
HF_TOKEN, HF_HOME, endpoint and offline switches; kiln_pants.hub_settings): read from the mounted
named cache into the environment before anything imports huggingface_hub, which reads some of
them once at import. Variables already set in the environment win."""

from __future__ import annotations

import json
import os
from pathlib import Path

from kiln_contract.tokenize import HUB_SETTINGS_DIR, HUB_VARIABLES, hub_settings_file


def settings_path() -> Path:
    """The mounted settings of the Pants process that started this one."""
    return Path(HUB_SETTINGS_DIR) / hub_settings_file(os.getppid())


def apply_hub_settings(path: Path | None = None) -> list[str]:
    """Sets the known variables the file (default: `settings_path()`) holds and the environment
    lacks; returns their names (never their values: a token is no log line)."""
    path = path or settings_path()
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
