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
import re
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


MIN_PLOT_PX = 20  # a plot (SVG) less tall than this counts as empty: its titles squeezed it away

# Installed in every document before its own scripts: remembers each text a canvas draws (Vega's canvas
# renderer draws titles and labels with fillText, already truncated with "…" where it had to cut them),
# with its box in the canvas's pixels, so that the page check can tell a cut or clipped axis title. A
# clear of (nearly) the whole canvas starts a new frame.
TEXT_RECORDER_JS = r"""
(() => {
  if (window.__chunkledgerTexts) return;
  const frames = new WeakMap();
  window.__chunkledgerTexts = frames;
  const P = CanvasRenderingContext2D.prototype;
  const clear = P.clearRect, fill = P.fillText;
  P.clearRect = function (x, y, w, h) {
    try {
      const m = this.getTransform();
      if (Math.abs(m.a * w) >= this.canvas.width * 0.9 && Math.abs(m.d * h) >= this.canvas.height * 0.9)
        frames.set(this.canvas, []);
    } catch (e) {}
    return clear.apply(this, arguments);
  };
  P.fillText = function (text, x, y) {
    try {
      const m = this.getTransform(), t = this.measureText(String(text));
      const l = x - t.actualBoundingBoxLeft, r = x + t.actualBoundingBoxRight;
      const top = y - t.actualBoundingBoxAscent, bottom = y + t.actualBoundingBoxDescent;
      const pts = [[l, top], [r, top], [l, bottom], [r, bottom]].map(
        ([px, py]) => [m.a * px + m.c * py + m.e, m.b * px + m.d * py + m.f]);
      const xs = pts.map(p => p[0]), ys = pts.map(p => p[1]);
      if (!frames.has(this.canvas)) frames.set(this.canvas, []);
      frames.get(this.canvas).push({
        text: String(text), font: this.font, rotated: Math.abs(m.b) > 1e-6,
        x0: Math.min(...xs), x1: Math.max(...xs), y0: Math.min(...ys), y1: Math.max(...ys),
        w: this.canvas.width, h: this.canvas.height,
      });
    } catch (e) {}
    return fill.apply(this, arguments);
  };
})();
"""

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
    // texts cut short ("…"), drawn past the edge of their canvas / SVG (by more than 1 px), or axis
    // titles longer than their axis (the plot's height or width)
    const cut = [];
    const past = (t, w, h) => t.x0 < -1 || t.y0 < -1 || t.x1 > w + 1 || t.y1 > h + 1;
    for (const cv of c.querySelectorAll('canvas')) {
      for (const t of (window.__chunkledgerTexts && window.__chunkledgerTexts.get(cv)) || []) {
        if (/(…|\.\.\.)$/.test(t.text) || past(t, cv.width, cv.height)) cut.push({...t, why: 'canvas'});
      }
    }
    for (const svg of c.querySelectorAll('svg.marks')) {
      const box = svg.getBoundingClientRect();
      const bg = svg.querySelector('.role-frame.root > g > path.background');
      const plot = bg ? bg.getBoundingClientRect() : null;
      for (const el of svg.querySelectorAll('text')) {
        const r = el.getBoundingClientRect(), text = el.textContent || '';
        const t = {text, x0: r.left - box.left, y0: r.top - box.top, x1: r.right - box.left,
                   y1: r.bottom - box.top, w: box.width, h: box.height};
        const title = !!el.closest('.role-axis-title');
        const vertical = r.height > r.width;
        if (/(…|\.\.\.)$/.test(text)) cut.push({...t, why: 'ellipsis'});
        else if (past(t, box.width, box.height)) cut.push({...t, why: 'past the edge'});
        else if (title && plot && (vertical ? r.height > plot.height + 2 : r.width > plot.width + 2))
          cut.push({...t, why: 'longer than its axis', plot: [plot.width, plot.height]});
      }
    }
    // every distinct text drawn in the chart (titles, axis and legend labels), for the legend checks
    const labels = new Set();
    for (const cv of c.querySelectorAll('canvas'))
      for (const t of (window.__chunkledgerTexts && window.__chunkledgerTexts.get(cv)) || [])
        labels.add(t.text);
    for (const el of c.querySelectorAll('svg.marks text')) labels.add(el.textContent || '');
    const texts = Array.from(c.querySelectorAll('canvas')).reduce(
      (n, cv) => n + ((window.__chunkledgerTexts && window.__chunkledgerTexts.get(cv)) || []).length, 0)
      + c.querySelectorAll('svg.marks text').length;
    // data marks with an area on screen (a bar squeezed to 0 px is not drawn)
    const marks = Array.from(c.querySelectorAll('svg .mark-rect path, svg .mark-line path,'
      + ' svg .mark-area path, svg .mark-symbol path, svg .mark-tick path')).filter(p => {
        const r = p.getBoundingClientRect(); return r.width >= 1 && r.height >= 1; }).length;
    // the plot's height (SVG): a plot squeezed by its titles and axes draws nothing readable
    const frame = c.querySelector('svg.marks .role-frame.root > g > path.background');
    const plot_h = frame ? frame.getBoundingClientRect().height : null;
    return {coloured, marks, plot_h, w: c.clientWidth, h: c.clientHeight, cut, texts,
            labels: Array.from(labels).slice(0, 5000)};
  });
  return {
    ready: !!document.querySelector('[data-testid="stMain"] [data-testid="stElementContainer"]') && !running,
    title: (document.querySelector('h1') || {}).innerText || '',
    exceptions: q('[data-testid="stException"]').map(e => e.innerText.slice(0, 500)),
    errors: q('[data-testid="stAlertContentError"]').map(e => e.innerText.slice(0, 300)),
    deploy: q('[data-testid="stAppDeployButton"], [data-testid="stDeployButton"]').filter(
      e => e.offsetParent !== null).length > 0,
    doc_title: document.title,
    favicon: (document.querySelector('link[rel~="icon"]') || {}).href || '',
    tables: q('[data-testid="stDataFrame"], [data-testid="stTable"]').length,
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
    deploy: bool = False
    doc_title: str = ""
    favicon: str = ""
    tables: int = 0

    @property
    def empty_charts(self) -> list[int]:
        return [
            i
            for i, c in enumerate(self.charts)
            if (c["coloured"] <= 20 and c["marks"] == 0)
            or (c.get("plot_h") is not None and c["plot_h"] < MIN_PLOT_PX)
        ]

    def labels_matching(self, pattern: str) -> list[int]:
        """Per chart, how many distinct texts it drew match ``pattern`` (a regular expression matched
        in full), e.g. how many engine ids its legend names."""
        rx = re.compile(pattern)
        return [sum(1 for t in c.get("labels", []) if rx.fullmatch(t)) for c in self.charts]

    @property
    def cut_texts(self) -> list[tuple[int, str, str]]:
        """(chart, text, why) of every title or label drawn cut short ("…") or past its chart's edge,
        and of every axis title longer than its axis."""
        return [(i, t["text"], t.get("why", "")) for i, c in enumerate(self.charts) for t in c.get("cut", [])]


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
        self.send("Page.addScriptToEvaluateOnNewDocument", source=TEXT_RECORDER_JS)
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

    def main_menu(self) -> list[str]:
        """Open Streamlit's main menu (top right) and return its items' texts ([] when there is none)."""
        opened = self.evaluate(
            """(() => { const b = document.querySelector('[data-testid="stMainMenuButton"], '
              + '[data-testid="stMainMenu"] button'); if (!b) return false; b.click(); return true; })()"""
        )
        if not opened:
            return []
        items: list[str] = []
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not items:
            time.sleep(0.25)
            items = (
                self.evaluate(
                    """Array.from(document.querySelectorAll('[data-testid="stMainMenuList"] li, '
                  + '[data-testid="stMainMenuPopover"] li, [role="menu"] li, [role="menuitem"], '
                  + '[role="option"]')).map(e => e.innerText.trim()).filter(t => t)"""
                )
                or []
            )
        for kind in ("keyDown", "keyUp"):
            self.send(
                "Input.dispatchKeyEvent", type=kind, key="Escape", code="Escape", windowsVirtualKeyCode=27
            )
        return list(items)

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
