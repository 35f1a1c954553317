"""Headless Chromium opens the control page and clicks "Save checkpoint" like a person would.

Chromium is driven over the Chrome DevTools Protocol through `--remote-debugging-pipe` (JSON
messages separated by NUL on file descriptors 3 and 4), which needs nothing beyond the standard
library: no selenium, no chromedriver, no websocket client. The click is a real mouse press and
release at the button's on-screen centre, not a script calling .click(); the page runs no script.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import select
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kiln.control.server import ACCEPTED_TEXT, ControlServer

CHROMIUM = "/usr/bin/chromium"
TIMEOUT_SECONDS = 30.0

pytestmark = pytest.mark.skipif(
    not os.path.exists(CHROMIUM),
    reason=f"{CHROMIUM} is missing (Debian: apt-get install -y chromium)",
)


class Chromium:
    """A headless Chromium and one page in it, spoken to over the DevTools pipe."""

    def __init__(self, profile_dir: Path) -> None:
        to_browser_r, to_browser_w = os.pipe()
        from_browser_r, from_browser_w = os.pipe()
        # Move the child's ends above 3 and 4 so that placing them there cannot clobber each other.
        child_in = fcntl.fcntl(to_browser_r, fcntl.F_DUPFD, 10)
        child_out = fcntl.fcntl(from_browser_w, fcntl.F_DUPFD, 10)
        for fd in (to_browser_r, from_browser_w):
            os.close(fd)

        def place_pipe_fds() -> None:
            os.dup2(child_in, 3)
            os.dup2(child_out, 4)

        self.process = subprocess.Popen(
            [
                CHROMIUM,
                "--headless",
                "--no-sandbox",  # required as root
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--disable-quic",
                "--no-first-run",
                "--no-proxy-server",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                f"--user-data-dir={profile_dir}",
                "--remote-debugging-pipe",
                "about:blank",
            ],
            pass_fds=(3, 4),
            preexec_fn=place_pipe_fds,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for fd in (child_in, child_out):
            os.close(fd)
        self._out, self._in = to_browser_w, from_browser_r
        self._buffer = b""
        self._next_id = 0
        self._events: list[dict[str, Any]] = []
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)[
            "sessionId"
        ]

    def close(self) -> None:
        self.process.kill()
        self.process.wait(timeout=10)
        os.close(self._out)
        os.close(self._in)

    def _receive(self, deadline: float) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([self._in], [], [], remaining)[0]:
                raise TimeoutError("Chromium did not answer over the DevTools pipe")
            chunk = os.read(self._in, 1 << 16)
            if not chunk:
                raise RuntimeError(f"Chromium exited (code {self.process.poll()})")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def call(self, method: str, session: str | None = None, **params: Any) -> dict[str, Any]:
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params}
        if session:
            message["sessionId"] = session
        os.write(self._out, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + TIMEOUT_SECONDS
        while True:
            reply = self._receive(deadline)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]
            self._events.append(reply)

    def page(self, method: str, **params: Any) -> dict[str, Any]:
        return self.call(method, self.session, **params)

    def wait_for_load(self) -> None:
        deadline = time.monotonic() + TIMEOUT_SECONDS
        while True:
            for event in self._events:
                if event.get("method") == "Page.loadEventFired":
                    self._events.clear()
                    return
            self._events.clear()
            self._events.append(self._receive(deadline))

    def navigate(self, url: str) -> None:
        self._events.clear()
        self.page("Page.navigate", url=url)
        self.wait_for_load()

    def screenshot(self, path: Path) -> None:
        path.write_bytes(
            base64.b64decode(self.page("Page.captureScreenshot", format="png")["data"])
        )

    def _node(self, selector: str) -> int:
        root = self.page("DOM.getDocument")["root"]["nodeId"]
        node = self.page("DOM.querySelector", nodeId=root, selector=selector)["nodeId"]
        if not node:
            raise AssertionError(f"no element matches {selector!r}")
        return node

    def click(self, selector: str) -> None:
        node = self._node(selector)
        self.page("DOM.scrollIntoViewIfNeeded", nodeId=node)
        quad = self.page("DOM.getBoxModel", nodeId=node)["model"]["content"]
        x, y = sum(quad[0::2]) / 4, sum(quad[1::2]) / 4
        for kind in ("mousePressed", "mouseReleased"):
            self.page("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=1)

    def html(self) -> str:
        root = self.page("DOM.getDocument")["root"]["nodeId"]
        return self.page("DOM.getOuterHTML", nodeId=root)["outerHTML"]


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Chromium]:
    chromium = Chromium(tmp_path / "profile")
    try:
        chromium.page("Page.enable")
        chromium.page(
            "Emulation.setDeviceMetricsOverride",
            width=1000,
            height=1100,
            deviceScaleFactor=1,
            mobile=False,
        )
        yield chromium
    finally:
        chromium.close()
        shutil.rmtree(tmp_path / "profile", ignore_errors=True)


def test_clicking_save_checkpoint_requests_one(browser: Chromium, tmp_path: Path) -> None:
    server = ControlServer(
        tmp_path / "run",
        {"run_id": "browser-test", "name": "checkpoints/quickstart", "version": "2026.11.29"},
        {"model": {"hidden_dim": 64}, "wandb": {"api_key": "notshownanywhere123"}},
    )
    url = server.start()
    try:
        server.update(step=12, total_steps=100, loss=3.5, tokens_per_second=2000.0, eta_seconds=60)
        browser.navigate(url)
        page = browser.html()
        assert "checkpoints/quickstart" in page and "12 / 100" in page
        assert "notshownanywhere123" not in page
        browser.screenshot(Path(os.environ.get("KILN_SCREENSHOT_DIR", tmp_path)) / "control.png")
        assert server.take_checkpoint_request() is False

        browser.click("form button[type=submit]")
        browser.wait_for_load()

        assert ACCEPTED_TEXT.strip() in browser.html()
        assert server.take_checkpoint_request() is True
        assert server.take_checkpoint_request() is False
    finally:
        server.stop()
