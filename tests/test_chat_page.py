"""The chat page at GET / in a real browser: Debian's headless chromium, driven over the Chrome
DevTools Protocol with aiohttp's websocket client (no npm package, no downloaded browser).

It types a message, watches the answer stream in, and checks the answer equals what the API
returns for the same greedy request, that TTFT and tokens/s are shown, that a second turn sends
the whole conversation, and that the page fetched nothing but the gateway's own URLs.
Skipped, with the reason, when /usr/bin/chromium is absent (scripts/ensure-chromium.sh installs it).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from pdserve.ports import free_port
from pdserve.stack import start_stack

CHROMIUM = Path("/usr/bin/chromium")
pytestmark = pytest.mark.skipif(not CHROMIUM.exists(),
                                reason="/usr/bin/chromium is absent: run scripts/ensure-chromium.sh (as root) "
                                       "to install Debian's chromium for the chat page test")
MODEL = "stories260K"
MAX_TOKENS = 160  # long enough that the answer takes many events to arrive
STATS = re.compile(r"TTFT \d+ ms · [\d.]+ tokens/s · (\d+) tokens · (length|stop)")


@pytest.fixture(scope="module")
def stack():
    s = start_stack(1, 1, "--http-port", str(free_port()))
    yield s
    s.stop()


class Browser:
    """Headless chromium with a fresh profile, and the DevTools websocket URL of its first page."""

    FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--remote-debugging-port=0")

    def __init__(self) -> None:
        self.profile = tempfile.TemporaryDirectory(prefix="pdserve-chromium-")
        self.proc = subprocess.Popen([str(CHROMIUM), *self.FLAGS, f"--user-data-dir={self.profile.name}",
                                      "about:blank"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def devtools_port(self, timeout_s: float = 30.0) -> int:
        # With --remote-debugging-port=0 chromium picks a port and writes it to the profile.
        active = Path(self.profile.name) / "DevToolsActivePort"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"chromium exited with {self.proc.returncode}: {self.proc.stderr.read()[-2000:]!r}")
            if active.exists() and (text := active.read_text().split("\n"))[0].isdigit():
                return int(text[0])
            time.sleep(0.05)
        raise TimeoutError("chromium did not open its DevTools port")

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.profile.cleanup()


@pytest.fixture(scope="module")
def browser():
    b = Browser()
    yield b
    b.close()


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

    async def type_and_send(self, text: str) -> None:
        """Type like a person: focus the box, insert the text, press Enter."""
        await self.js("document.querySelector('#prompt').focus()")
        await self.send("Input.insertText", text=text)
        for kind in ("keyDown", "keyUp"):
            await self.send("Input.dispatchKeyEvent", type=kind, key="Enter", code="Enter",
                            windowsVirtualKeyCode=13, nativeVirtualKeyCode=13, **({"text": "\r"} if kind == "keyDown" else {}))


# Records every change of the newest answer's text with its time, to see it arrive in pieces.
TRACE_JS = """
window.__trace = [];
new MutationObserver(() => {
  const answers = document.querySelectorAll('.msg.assistant .text');
  const last = answers[answers.length - 1];
  if (last) window.__trace.push([performance.now(), last.textContent.length]);
}).observe(document.querySelector('#log'), {subtree: true, childList: true, characterData: true});
"""


async def _chat_turn(cdp: CDP, text: str, turn: int) -> tuple[str, str, list]:
    await cdp.js("window.__trace.length = 0")
    await cdp.type_and_send(text)
    done = f"document.querySelectorAll('.msg.assistant[data-done=\"1\"]').length === {turn}"
    await cdp.wait_for(done)
    answer, stats = await cdp.js("(() => { const a = [...document.querySelectorAll('.msg.assistant')].pop();"
                                 " return [a.querySelector('.text').textContent, a.querySelector('.stats').textContent]; })()")
    return answer, stats, await cdp.js("window.__trace")


async def _drive(base: str, port: int, client: openai.OpenAI) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.get(f"http://127.0.0.1:{port}/json/list") as r:
            page = next(t for t in await r.json() if t["type"] == "page")
        async with session.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0) as ws:
            cdp = CDP(ws)
            await cdp.send("Network.enable")
            await cdp.send("Page.navigate", url=base + "/")
            await cdp.wait_for("document.body && document.body.dataset.ready === '1'")
            assert (await cdp.js("document.querySelector('#model').textContent")).startswith(MODEL)
            await cdp.js(f"document.querySelector('#temperature').value = '0';"
                         f"document.querySelector('#max-tokens').value = '{MAX_TOKENS}'; {TRACE_JS}")

            conversation: list[dict[str, str]] = []
            for turn, text in enumerate(["Once upon a time there was a dragon", "What did the dragon eat?"], 1):
                answer, stats, trace = await _chat_turn(cdp, text, turn)
                conversation.append({"role": "user", "content": text})
                api = client.chat.completions.create(model=MODEL, messages=conversation, max_tokens=MAX_TOKENS,
                                                     temperature=0)
                assert answer == api.choices[0].message.content, (turn, answer)
                match = STATS.fullmatch(stats)
                assert match, stats
                assert int(match[1]) == api.usage.completion_tokens
                lengths = [n for _, n in trace]
                growing = sorted(set(n for n in lengths if 0 < n < len(answer)))
                assert len(growing) >= 3, f"the answer did not stream in pieces: {lengths}"
                conversation.append({"role": "assistant", "content": answer})

            urls = {e["params"]["request"]["url"] for e in cdp.events if e["method"] == "Network.requestWillBeSent"}
            assert urls and all(u.startswith(base + "/") for u in urls), urls
            cdp.reader.cancel()


def test_chat_page_streams_and_matches_the_api(browser, stack):  # chromium boots while the stack starts
    client = openai.OpenAI(base_url=stack.http_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    asyncio.run(_drive(stack.http_url, browser.devtools_port(), client))
