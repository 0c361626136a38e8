"""Headless Chromium driven over the DevTools protocol (a websocket), enough to load Streamlit pages,
wait for them to finish rendering, inspect the DOM and take screenshots.

Chromium runs with --headless --no-sandbox --disable-gpu --disable-background-networking.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from websockets.sync.client import connect

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "chrome")


def find_chromium() -> str | None:
    env = os.environ.get("CHUNKLEDGER_CHROMIUM")
    if env:
        return env
    for name in CHROMIUM_NAMES:
        path = shutil.which(name)
        if path:
            return path
    return None


# Runs in the page: what the test needs to know about a rendered Streamlit page. A chart counts as drawn
# when its canvas (or SVG) has coloured pixels / marks: axes and labels are grey, data marks are not.
PAGE_STATE_JS = r"""
(() => {
  const q = (s) => Array.from(document.querySelectorAll(s));
  const running = q('[data-testid="stStatusWidget"]').some(e => /Running|Connecting/i.test(e.innerText || ''))
    || q('[data-testid="stSkeleton"]').length > 0;
  const charts = q('[data-testid="stVegaLiteChart"], .vega-embed').filter(
    (e, i, all) => !all.some(o => o !== e && o.contains(e)));
  const drawn = charts.map(c => {
    let coloured = 0;
    for (const cv of c.querySelectorAll('canvas')) {
      try {
        const d = cv.getContext('2d').getImageData(0, 0, cv.width, cv.height).data;
        for (let i = 0; i < d.length; i += 16) {
          const mx = Math.max(d[i], d[i+1], d[i+2]), mn = Math.min(d[i], d[i+1], d[i+2]);
          if (d[i+3] > 0 && mx - mn > 60) coloured++;
        }
      } catch (e) { coloured = -1; }
    }
    const marks = c.querySelectorAll('svg .mark-rect path, svg .mark-line path, svg .mark-area path,'
      + ' svg .mark-symbol path, svg .mark-tick path').length;
    return {coloured, marks, w: c.clientWidth, h: c.clientHeight};
  });
  return {
    ready: !!document.querySelector('[data-testid="stMain"] [data-testid="stElementContainer"]') && !running,
    title: (document.querySelector('h1') || {}).innerText || '',
    exceptions: q('[data-testid="stException"]').map(e => e.innerText.slice(0, 500)),
    errors: q('[data-testid="stAlertContentError"]').map(e => e.innerText.slice(0, 300)),
    charts: drawn,
    text: document.body ? document.body.innerText.slice(0, 20000) : '',
  };
})()
"""


@dataclass
class PageState:
    ready: bool
    title: str
    exceptions: list[str]
    errors: list[str]
    charts: list[dict[str, Any]]
    text: str

    @property
    def empty_charts(self) -> list[int]:
        return [i for i, c in enumerate(self.charts) if c["coloured"] <= 20 and c["marks"] == 0]


class Browser:
    """One headless Chromium with one tab, driven over CDP."""

    def __init__(self, binary: str, width: int = 1400, height: int = 2200) -> None:
        self._profile = tempfile.mkdtemp(prefix="chunkledger-chromium-")
        self.proc = subprocess.Popen(
            [
                binary,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-dev-shm-usage",
                "--no-first-run",
                "--remote-debugging-port=0",
                f"--user-data-dir={self._profile}",
                f"--window-size={width},{height}",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        port = self._devtools_port()
        tabs = httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=5).json()
        page = next(t for t in tabs if t.get("type") == "page")
        self._stack = contextlib.ExitStack()
        self._ws = self._stack.enter_context(
            connect(page["webSocketDebuggerUrl"], max_size=64 * 1024 * 1024, open_timeout=10)
        )
        self._ids = itertools.count(1)
        self.send("Page.enable")
        self.send("Runtime.enable")
        self.send(
            "Emulation.setDeviceMetricsOverride",
            width=width,
            height=height,
            deviceScaleFactor=1,
            mobile=False,
        )

    def _devtools_port(self, timeout: float = 30.0) -> int:
        path = Path(self._profile) / "DevToolsActivePort"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if path.exists():
                text = path.read_text().split()
                if text:
                    return int(text[0])
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                raise RuntimeError(f"chromium exited with {self.proc.returncode}: {err[-2000:]}")
            time.sleep(0.05)
        raise TimeoutError("chromium did not open its DevTools port")

    def send(self, method: str, **params: Any) -> dict[str, Any]:
        msg_id = next(self._ids)
        self._ws.send(json.dumps({"id": msg_id, "method": method, "params": params}))
        while True:
            msg = json.loads(self._ws.recv(timeout=60))
            if msg.get("id") == msg_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return dict(msg.get("result", {}))

    def evaluate(self, expression: str) -> Any:
        out = self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in out:
            raise RuntimeError(f"page script failed: {out['exceptionDetails']}")
        return out["result"].get("value")

    def load(
        self, url: str, *, settle_s: float = 1.5, timeout: float = 90.0, min_charts: int = 0
    ) -> PageState:
        """Navigate and wait until Streamlit has finished running the page, at least ``min_charts``
        charts are there, and the DOM stopped changing for ``settle_s`` (charts render after the script
        run ends)."""
        self.send("Page.navigate", url=url)
        deadline = time.monotonic() + timeout
        last: tuple[Any, ...] | None = None
        stable_since = time.monotonic()
        state = PageState(False, "", [], [], [], "")
        while time.monotonic() < deadline:
            time.sleep(0.25)
            try:
                state = PageState(**self.evaluate(PAGE_STATE_JS))
            except RuntimeError:
                continue
            sig = (
                state.ready,
                len(state.charts),
                tuple(c["coloured"] > 20 for c in state.charts),
                len(state.text),
            )
            if sig != last:
                last, stable_since = sig, time.monotonic()
            elif (
                state.ready
                and (len(state.charts) >= min_charts or state.exceptions)
                and time.monotonic() - stable_since >= settle_s
            ):
                return state
        return state

    def screenshot(self, path: Path) -> None:
        data = self.send("Page.captureScreenshot", format="png", captureBeyondViewport=False)["data"]
        path.write_bytes(base64.b64decode(data))

    def close(self) -> None:
        try:
            self._stack.close()
        finally:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
            shutil.rmtree(self._profile, ignore_errors=True)
