"""A real headless chromium for tests, driven over the Chrome DevTools Protocol with aiohttp's
websocket client (no npm package, no downloaded browser): Debian's /usr/bin/chromium, installed by
scripts/ensure-chromium.sh. Tests that need it are marked `needs_chromium` (skipped, with the
reason, where it is absent)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import os
import signal
import json
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from waiting import wait_until

CHROMIUM = Path("/usr/bin/chromium")
needs_chromium = pytest.mark.skipif(not CHROMIUM.exists(),
                                    reason="/usr/bin/chromium is absent: run scripts/ensure-chromium.sh (as root) "
                                           "to install Debian's chromium for the chat page test")


class Browser:
    """Headless chromium with a fresh profile, and the DevTools websocket URL of its first page."""

    FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--remote-debugging-port=0")

    def __init__(self) -> None:
        # Its helper processes may still be writing to the profile when the browser exits: the
        # directory is removed best effort, a leftover file must not fail the test that used it.
        self.profile = tempfile.TemporaryDirectory(prefix="pdserve-chromium-", ignore_cleanup_errors=True)
        # Its own process group, so that close() stops the renderer and GPU helpers with it.
        self.proc = subprocess.Popen([str(CHROMIUM), *self.FLAGS, f"--user-data-dir={self.profile.name}",
                                      "about:blank"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     start_new_session=True)

    def devtools_port(self, timeout_s: float = 30.0) -> int:
        # With --remote-debugging-port=0 chromium picks a port and writes it to the profile.
        port = wait_until(self._written_port, timeout_s)
        if not port:
            raise TimeoutError("chromium did not open its DevTools port")
        return port

    def _written_port(self) -> int | None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"chromium exited with {self.proc.returncode}: {self.proc.stderr.read()[-2000:]!r}")
        active = Path(self.profile.name) / "DevToolsActivePort"
        if active.exists() and (text := active.read_text().split("\n"))[0].isdigit():
            return int(text[0])
        return None

    def close(self) -> None:
        self._signal_group(signal.SIGTERM)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._signal_group(signal.SIGKILL)
            self.proc.wait()
        self._signal_group(signal.SIGKILL)  # helpers that outlived the browser
        self.profile.cleanup()

    def _signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass


class CDP:
    """Just enough of the DevTools protocol: commands by id, events kept in order."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self.ids = itertools.count(1)
        self.pending: dict[int, asyncio.Future] = {}
        self.events: list[dict[str, Any]] = []
        self.reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        async for msg in self.ws:
            data = json.loads(msg.data)
            if "id" in data and data["id"] in self.pending:
                self.pending.pop(data["id"]).set_result(data)
            elif "method" in data:
                self.events.append(data)

    async def send(self, method: str, **params: Any) -> dict[str, Any]:
        msg_id = next(self.ids)
        self.pending[msg_id] = asyncio.get_running_loop().create_future()
        await self.ws.send_json({"id": msg_id, "method": method, "params": params})
        reply = await asyncio.wait_for(self.pending[msg_id], 30)
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return reply["result"]

    async def js(self, expression: str) -> Any:
        result = await self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def wait_for(self, expression: str, timeout_s: float = 30.0) -> Any:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if value := await self.js(expression):
                return value
            await asyncio.sleep(0.02)
        raise TimeoutError(f"page never satisfied {expression}")

    async def wait_event(self, method: str, after: int = 0, timeout_s: float = 30.0) -> dict[str, Any]:
        """The first `method` event at index `after` or later."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if found := [e for e in self.events[after:] if e["method"] == method]:
                return found[0]
            await asyncio.sleep(0.02)
        raise TimeoutError(f"no {method} event")

    async def type_and_send(self, text: str) -> None:
        """Type like a person: focus the box, insert the text, press Enter."""
        await self.js("document.querySelector('#prompt').focus()")
        await self.send("Input.insertText", text=text)
        await self.press("Enter")

    async def press(self, key: str, modifiers: int = 0) -> None:
        """Press and release a key (Enter, Escape, Tab...) in the focused element; `modifiers`:
        1 Alt, 2 Ctrl, 4 Meta, 8 Shift."""
        code, text = KEYS[key]
        for kind in ("keyDown", "keyUp"):
            await self.send("Input.dispatchKeyEvent", type=kind, key=key, code=key, modifiers=modifiers,
                            windowsVirtualKeyCode=code, nativeVirtualKeyCode=code,
                            **({"text": text} if kind == "keyDown" and text else {}))

    async def fulfil(self, paused: dict[str, Any], status: int, body: str | bytes,
                     headers: dict[str, str] | None = None) -> None:
        """Answer a Fetch.requestPaused request with `status`, `headers` and `body`."""
        raw = body.encode() if isinstance(body, str) else body
        await self.send("Fetch.fulfillRequest", requestId=paused["params"]["requestId"], responseCode=status,
                        responseHeaders=[{"name": k, "value": v} for k, v in (headers or {}).items()],
                        body=base64.b64encode(raw).decode())

    def requests(self, url_suffix: str, after: int = 0) -> list[dict[str, Any]]:
        """The requests the page sent (Network.requestWillBeSent's `request`) to URLs ending in
        `url_suffix`, from event index `after` on."""
        return [e["params"]["request"] for e in self.events[after:]
                if e["method"] == "Network.requestWillBeSent" and e["params"]["request"]["url"].endswith(url_suffix)]

    async def screenshot(self, path: Path) -> None:
        """The page's viewport as a PNG file."""
        shot = await self.send("Page.captureScreenshot", format="png")
        path.write_bytes(base64.b64decode(shot["data"]))


# Virtual key code and the text a key types, for Input.dispatchKeyEvent.
KEYS = {"Enter": (13, "\r"), "Escape": (27, ""), "Tab": (9, "")}


@contextlib.asynccontextmanager
async def open_page(browser: Browser, base: str, intercept: tuple[str, ...] = (), *,
                    local: Mapping[str, str] | None = None, session: Mapping[str, str] | None = None
                    ) -> AsyncIterator[CDP]:
    """The chat page with its origin's storage empty (no conversation, no key) but for `local`
    (localStorage) and `session` (sessionStorage) items; requests to URLs matching `intercept`
    (glob patterns) pause, as Fetch.requestPaused events, until the test continues or fulfils them."""
    async with aiohttp.ClientSession() as session_:
        async with session_.get(f"http://127.0.0.1:{browser.devtools_port()}/json/list") as r:
            page = next(t for t in await r.json() if t["type"] == "page")
        async with session_.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0) as ws:
            cdp = CDP(ws)
            try:
                await cdp.send("Network.enable")
                await cdp.send("Page.enable")
                await cdp.send("Page.navigate", url=base + "/health")  # same origin: forget the last test's chats
                await cdp.wait_event("Page.loadEventFired")
                seeds = json.dumps({"localStorage": dict(local or {}), "sessionStorage": dict(session or {})})
                await cdp.js(f"""sessionStorage.clear(); localStorage.clear();
                  for (const [store, items] of Object.entries({seeds}))
                    for (const [k, v] of Object.entries(items)) window[store].setItem(k, v);""")
                if intercept:
                    await cdp.send("Fetch.enable", patterns=[{"urlPattern": p} for p in intercept])
                await cdp.send("Page.navigate", url=base + "/")
                yield cdp
            finally:
                cdp.reader.cancel()
