"""A real headless Chromium driven over the Chrome DevTools Protocol (websocket-client, already pinned).

Enough for page tests: open a URL, evaluate JavaScript, type and click with real input events, wait for a
condition, take a screenshot, and collect the page's uncaught JavaScript exceptions. The browser is
Debian's `chromium` (`make browser` installs it); `find_chromium()` says where it is or why it is missing.
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import websocket

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_chromium() -> str | None:
    """The browser binary: $CHROMIUM, else the first of CANDIDATES on PATH."""
    explicit = os.environ.get("CHROMIUM")
    if explicit:
        return explicit
    return next((path for name in CANDIDATES if (path := shutil.which(name))), None)


class BrowserError(RuntimeError):
    pass


class HeadlessBrowser:
    """One headless browser with one page; use as a context manager."""

    def __init__(self, binary: str, width: int = 1500, height: int = 1100, timeout_s: float = 30.0):
        self.profile = tempfile.mkdtemp(prefix="chromium-profile-")
        self.proc = subprocess.Popen(
            [
                binary,
                "--headless=new",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--no-first-run",
                "--no-default-browser-check",
                "--remote-debugging-port=0",
                "--remote-allow-origins=*",
                f"--user-data-dir={self.profile}",
                f"--window-size={width},{height}",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self._ids = itertools.count(1)
        self.exceptions: list[str] = []  # uncaught JavaScript exceptions and console errors of the page
        try:
            port = self._devtools_port(timeout_s)
            page = self._page_target(port, timeout_s)
            self.ws = websocket.create_connection(page["webSocketDebuggerUrl"], timeout=timeout_s, suppress_origin=True)
            for domain in ("Page", "Runtime"):
                self.call(f"{domain}.enable")
        except Exception:
            self.close()
            raise

    def _devtools_port(self, timeout_s: float) -> int:
        marker = Path(self.profile) / "DevToolsActivePort"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise BrowserError(f"chromium exited at start with status {self.proc.returncode}")
            if marker.exists() and marker.read_text().strip():
                return int(marker.read_text().split()[0])
            time.sleep(0.05)
        raise BrowserError("chromium did not open its DevTools port")

    @staticmethod
    def _page_target(port: int, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=timeout_s) as resp:
                pages = [t for t in json.load(resp) if t.get("type") == "page"]
            if pages or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        if not pages:
            raise BrowserError("chromium has no page target")
        return pages[0]

    def __enter__(self) -> HeadlessBrowser:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        ws = getattr(self, "ws", None)
        if ws is not None:
            ws.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.profile, ignore_errors=True)

    # ---- protocol ------------------------------------------------------------------------------------
    def call(self, method: str, **params) -> dict:
        """Send one DevTools command and return its result; events that arrive meanwhile are noted."""
        message_id = next(self._ids)
        self.ws.send(json.dumps({"id": message_id, "method": method, "params": params}))
        while True:
            message = json.loads(self.ws.recv())
            if message.get("id") == message_id:
                if "error" in message:
                    raise BrowserError(f"{method}: {message['error']}")
                return message.get("result", {})
            self._note_event(message)

    def _note_event(self, message: dict) -> None:
        if message.get("method") == "Runtime.exceptionThrown":
            details = message["params"]["exceptionDetails"]
            self.exceptions.append(details.get("exception", {}).get("description") or details.get("text", "?"))
        elif message.get("method") == "Runtime.consoleAPICalled" and message["params"].get("type") == "error":
            self.exceptions.append(
                " ".join(str(a.get("value", a.get("description", ""))) for a in message["params"].get("args", []))
            )

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression (promises awaited)."""
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            details = result["exceptionDetails"]
            raise BrowserError(f"{expression!r} threw: {details.get('exception', {}).get('description', details)}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout_s: float = 30.0, poll_s: float = 0.1) -> Any:
        """Evaluate `expression` until it is truthy; returns that value."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise BrowserError(f"timed out after {timeout_s:.0f} s waiting for {expression!r} (last: {value!r})")
            time.sleep(poll_s)

    # ---- a person's actions --------------------------------------------------------------------------
    def open(self, url: str, timeout_s: float = 30.0) -> None:
        self.call("Page.navigate", url=url)
        self.wait_for(f"document.readyState === 'complete' && location.href.startsWith({json.dumps(url)})", timeout_s)

    def click(self, selector: str) -> None:
        """A real mouse click at the centre of the element."""
        box = self.evaluate(
            f"(() => {{ const e = document.querySelector({json.dumps(selector)});"
            " e.scrollIntoView({block: 'center'});"
            " const r = e.getBoundingClientRect(); return [r.x + r.width / 2, r.y + r.height / 2]; })()"
        )
        x, y = box
        for kind in ("mousePressed", "mouseReleased"):
            self.call("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=1)

    def fill(self, selector: str, text: str) -> None:
        """Click into a field, empty it, and type `text` into it."""
        self.click(selector)
        self.evaluate(f"document.querySelector({json.dumps(selector)}).value = ''")
        self.call("Input.insertText", text=text)

    def screenshot(self, path: Path) -> Path:
        data = self.call("Page.captureScreenshot", format="png")["data"]
        path.write_bytes(base64.b64decode(data))
        return path
