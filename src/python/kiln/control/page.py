"""The control page: one server-rendered HTML document, no script (the CSP forbids any).

Everything shown passes through kiln.control.redact first and html.escape last. The form posts
to the relative URL `checkpoint`, which resolves under the capability prefix `/c/<token>/`, so the
page never contains the capability token itself; it does contain the per-process CSRF token.
"""

from __future__ import annotations

import html
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kiln.control.redact import redact, redact_environment

CSRF_FIELD = "csrf_token"
REFRESH_SECONDS = 30

_STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5em auto; max-width: 60em; color: #222; }
h1 { font-size: 1.4em; margin-bottom: 0.2em; }
h2 { font-size: 1.1em; margin-top: 1.5em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; }
td, th { text-align: left; padding: 0.15em 1em 0.15em 0; vertical-align: top; }
th { color: #555; font-weight: normal; }
pre, td.value { font: 12px/1.3 ui-monospace, monospace; white-space: pre-wrap; word-break: break-all; }
pre { background: #f6f6f6; padding: 0.8em; }
button { font-size: 1em; padding: 0.4em 1.2em; margin-top: 0.6em; }
.muted { color: #777; }
"""


@dataclass(frozen=True)
class Progress:
    """What the trainer last reported; None where it has not reported a value yet."""

    step: int | None = None
    total_steps: int | None = None
    loss: float | None = None
    tokens_per_second: float | None = None
    eta_seconds: float | None = None
    last_checkpoint: str | None = None


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


def _number(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _step(progress: Progress) -> str:
    if progress.step is None:
        return "not started"
    if progress.total_steps is None:
        return str(progress.step)
    return f"{progress.step} / {progress.total_steps}"


def _rows(pairs: Mapping[str, Any], value_class: str = "") -> str:
    cls = f' class="{value_class}"' if value_class else ""
    return "\n".join(
        f"<tr><th>{html.escape(str(name))}</th><td{cls}>{html.escape(str(value))}</td></tr>"
        for name, value in pairs.items()
    )


def render_page(
    progress: Progress,
    run_info: Mapping[str, Any],
    config: Mapping[str, Any],
    environment: Mapping[str, str],
    csrf_token: str,
) -> bytes:
    info = redact(dict(run_info))
    title = f"{info.get('name', 'run')} {info.get('version', '')}".strip()
    status = {
        "step": _step(progress),
        "loss": _number(progress.loss, ".4f"),
        "tokens/s": _number(progress.tokens_per_second, ",.0f"),
        "ETA": _duration(progress.eta_seconds),
        "last checkpoint": progress.last_checkpoint or "-",
    }
    config_json = json.dumps(redact(dict(config)), indent=2, sort_keys=True, default=str)
    document = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="refresh" content="{REFRESH_SECONDS}">
<title>Kiln training control: {html.escape(title)}</title>
<style>{_STYLE}</style></head>
<body>
<h1>{html.escape(title)}</h1>
<table>
{_rows({"run id": info.get("run_id", "-"), **{k: v for k, v in info.items() if k != "run_id"}})}
</table>
<h2>Progress</h2>
<table>
{_rows(status)}
</table>
<form method="post" action="checkpoint">
<input type="hidden" name="{CSRF_FIELD}" value="{html.escape(csrf_token)}">
<button type="submit">Save checkpoint</button>
<span class="muted">The save starts after the current training step.</span>
</form>
<h2>Resolved config</h2>
<pre>{html.escape(config_json)}</pre>
<h2>Environment</h2>
<table>
{_rows(redact_environment(environment), value_class="value")}
</table>
<p class="muted">Secret-looking names and values are shown as [redacted].
This page refreshes every {REFRESH_SECONDS} s.</p>
</body></html>
"""
    return document.encode("utf-8")
