"""The chat page at GET / in a real browser: Debian's headless chromium, driven over the Chrome
DevTools Protocol with aiohttp's websocket client (no npm package, no downloaded browser).

It types a message, watches the answer stream in, and checks the answer equals what the API
returns for the same greedy request, that TTFT and tokens/s are shown, that a second turn sends
the whole conversation, and that the page fetched nothing but the gateway's own URLs. Then the
page's Markdown renderer: fixed strings become the expected elements, and HTML in an answer
(also streamed, in pieces) shows as text and runs nothing. Stop keeps the partial answer with its
token count, and a message sent before the model list loads waits in the box and then goes.
The browser tests are skipped, with the reason, when /usr/bin/chromium is absent
(scripts/ensure-chromium.sh installs it).
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
from pathlib import Path
from typing import Any

import openai
import pytest

from pdserve.ports import free_port
from pdserve.stack import start_stack
from browser import CDP, Browser, needs_chromium, open_page

PAGE = Path(__file__).resolve().parents[1] / "gateway" / "http" / "static" / "index.html"

MODEL = "stories260K"
MAX_TOKENS = 160  # long enough that the answer takes many events to arrive
STATS = re.compile(r"TTFT \d+ ms · [\d.]+ tokens/s · (\d+) tokens · (length|stop)")
STOPPED = re.compile(r"TTFT \d+ ms · [\d.]+ tokens/s · ≥ (\d+) tokens · stopped")


@pytest.fixture(scope="module")
def stack():
    s = start_stack(1, 1, "--http-port", str(free_port()))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def browser():
    b = Browser()
    yield b
    b.close()


async def _ready(cdp: CDP, max_tokens: int = MAX_TOKENS, temperature: float = 0.0) -> None:
    await cdp.wait_for("document.body && document.body.dataset.ready === '1'")
    await cdp.js(f"document.querySelector('#temperature').value = '{temperature}';"
                 f"document.querySelector('#max-tokens').value = '{max_tokens}'; {TRACE_JS}")


# Records every change of the newest answer's text with its time, to see it arrive in pieces.
TRACE_JS = """
window.__trace = [];
new MutationObserver(() => {
  const answers = document.querySelectorAll('.msg.assistant .text');
  const last = answers[answers.length - 1];
  if (last) window.__trace.push([performance.now(), last.textContent.length]);
}).observe(document.querySelector('#log'), {subtree: true, childList: true, characterData: true});
"""
LAST_ANSWER_JS = """(() => {
  const a = [...document.querySelectorAll('.msg.assistant')].pop();
  const chat = JSON.parse(sessionStorage.getItem('pdserve-chat'));
  const stored = chat.messages.filter((m) => m.role === 'assistant').pop();
  return {text: a.querySelector('.text').textContent, stats: a.querySelector('.stats').textContent,
          events: Number(a.dataset.events), stored: stored && stored.content,
          rendered: stored && pdserveChat.markdown(stored.content).textContent,
          paragraphs: a.querySelectorAll('.text > p').length};
})()"""


async def _chat_turn(cdp: CDP, text: str, turn: int) -> tuple[dict[str, Any], list]:
    await cdp.js("window.__trace.length = 0")
    await cdp.type_and_send(text)
    await cdp.wait_for(f"document.querySelectorAll('.msg.assistant[data-done=\"1\"]').length === {turn}")
    return await cdp.js(LAST_ANSWER_JS), await cdp.js("window.__trace")


async def _two_turns(browser: Browser, base: str, client: openai.OpenAI) -> None:
    async with open_page(browser, base) as cdp:
        await _ready(cdp)
        assert (await cdp.js("document.querySelector('#model').textContent")).startswith(MODEL)
        conversation: list[dict[str, str]] = []
        for turn, text in enumerate(["Once upon a time there was a dragon", "What did the dragon eat?"], 1):
            answer, trace = await _chat_turn(cdp, text, turn)
            conversation.append({"role": "user", "content": text})
            api = client.chat.completions.create(model=MODEL, messages=conversation, max_tokens=MAX_TOKENS,
                                                 temperature=0)
            # What the page keeps (and sends back next turn) is the model's text; what it shows is
            # that text's Markdown: for a story, paragraphs.
            assert answer["stored"] == api.choices[0].message.content, (turn, answer)
            assert answer["text"] == answer["rendered"] and answer["paragraphs"] >= 1, answer
            match = STATS.fullmatch(answer["stats"])
            assert match, answer["stats"]
            assert int(match[1]) == api.usage.completion_tokens
            lengths = [n for _, n in trace]
            growing = sorted(set(n for n in lengths if 0 < n < len(answer["text"])))
            assert len(growing) >= 3, f"the answer did not stream in pieces: {lengths}"
            conversation.append({"role": "assistant", "content": answer["stored"]})

        urls = {e["params"]["request"]["url"] for e in cdp.events if e["method"] == "Network.requestWillBeSent"}
        assert urls and all(u.startswith(base + "/") for u in urls), urls


@needs_chromium
def test_chat_page_streams_and_matches_the_api(browser, stack):  # chromium boots while the stack starts
    client = openai.OpenAI(base_url=stack.http_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    asyncio.run(_two_turns(browser, stack.http_url, client))


# ---- Markdown ----------------------------------------------------------------------------------

# The rendered fragment as nested lists: [tag, {attributes}?, *children]; a text node is its string.
SHAPE_JS = """(source) => {
  const shape = (n) => {
    if (n.nodeType === Node.TEXT_NODE) return n.data;
    const attrs = Object.fromEntries([...n.attributes].map((a) => [a.name, a.value]));
    return [n.nodeName.toLowerCase(), ...(n.attributes.length ? [attrs] : []), ...[...n.childNodes].map(shape)];
  };
  return [...pdserveChat.markdown(source).childNodes].map(shape);
}"""
LINK = {"href": "https://example.com/a?b=1", "rel": "noopener noreferrer", "target": "_blank"}
MARKDOWN_CASES = [
    ("Hello **world** and *you*, `x < y`.",
     [["p", "Hello ", ["strong", "world"], " and ", ["em", "you"], ", ", ["code", "x < y"], "."]]),
    ("# Title\n\nPara one\nline two\n\n- a\n- **b**\n  - c\n\n1. one\n2. two",
     [["h1", "Title"], ["p", "Para one", ["br"], "line two"],
      ["ul", ["li", "a"], ["li", ["strong", "b"], ["ul", ["li", "c"]]]],
      ["ol", ["li", "one"], ["li", "two"]]]),
    ("Steps:\n3. first\n4. second", [["p", "Steps:"], ["ol", {"start": "3"}, ["li", "first"], ["li", "second"]]]),
    ("Try:\n```python\nif a < b:\n    print('<b>')\n```\nDone",
     [["p", "Try:"], ["pre", ["code", {"data-lang": "python"}, "if a < b:\n    print('<b>')"]], ["p", "Done"]]),
    ("```\nstill streaming <i>", [["pre", ["code", "still streaming <i>"]]]),  # an unclosed fence
    ("1. Install:\n   ```sh\n   pip install x\n   ```\n2. Run",
     [["ol", ["li", "Install:", ["pre", ["code", {"data-lang": "sh"}, "pip install x"]]], ["li", "Run"]]]),
    ("- one\n\n- two\n  more", [["ul", ["li", ["p", "one"]], ["li", ["p", "two", ["br"], "more"]]]]),  # loose
    ("## Sub\n> quoted **b**\n\n---", [["h2", "Sub"], ["blockquote", ["p", "quoted ", ["strong", "b"]]], ["hr"]]),
    ("snake_case_name, 2 * 3 * 4 and \\*not italic\\*", [["p", "snake_case_name, 2 * 3 * 4 and *not italic*"]]),
    ("[ok](https://example.com/a?b=1) [js](javascript:alert) [rel](/v1/models) https://bare.example",
     [["p", ["a", LINK, "ok"], " [js](javascript:alert) [rel](/v1/models) https://bare.example"]]),
    # HTML is text, wherever it is
    ('<img src=x onerror="window.__pwned=1"> <script>window.__pwned=2</script>',
     [["p", '<img src=x onerror="window.__pwned=1"> <script>window.__pwned=2</script>']]),
    ("**<b>x</b>** `<script>` [<i>a</i>](https://example.com/a?b=1)",
     [["p", ["strong", "<b>x</b>"], " ", ["code", "<script>"], " ", ["a", LINK, "<i>a</i>"]]]),
]


async def _shapes(browser: Browser, base: str) -> list:
    async with open_page(browser, base) as cdp:
        await _ready(cdp)
        cases = json.dumps([source for source, _ in MARKDOWN_CASES])
        return await cdp.js(f"{cases}.map({SHAPE_JS})")


@needs_chromium
def test_markdown_becomes_the_right_elements(browser, stack):
    for (source, want), got in zip(MARKDOWN_CASES, asyncio.run(_shapes(browser, stack.http_url)), strict=True):
        assert got == want, source


# An answer full of HTML that would run if it reached the DOM as HTML (the page's CSP allows
# inline handlers), cut into SSE events in the middle of its tags and Markdown.
HOSTILE = ('Here is **bold** and <img src=x onerror="window.__pwned=1">\n\n'
           '<script>window.__pwned=2</script><svg onload="window.__pwned=3"></svg>\n\n'
           '- item <iframe src="javascript:window.__pwned=4"></iframe>\n- [click](javascript:window.__pwned=5)\n\n'
           '```html\n<img src=y onerror="window.__pwned=6">\n```\n')
NEW_ELEMENTS_JS = """
window.__added = [];
new MutationObserver((records) => {
  for (const r of records) for (const n of r.addedNodes) if (n.nodeType === Node.ELEMENT_NODE)
    window.__added.push(n.nodeName, ...[...n.querySelectorAll('*')].map((e) => e.nodeName));
}).observe(document.querySelector('#log'), {subtree: true, childList: true});
"""


def _sse_body(text: str, pieces: int = 12) -> str:
    step = -(-len(text) // pieces)
    chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}]
    chunks += [{"choices": [{"index": 0, "delta": {"content": text[i:i + step]}, "finish_reason": None}]}
               for i in range(0, len(text), step)]
    chunks += [{"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
               {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 40, "total_tokens": 45}}]
    return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"


async def _hostile_answer(browser: Browser, base: str) -> dict[str, Any]:
    async with open_page(browser, base, intercept=("*/v1/chat/completions",)) as cdp:
        await _ready(cdp)
        await cdp.js(NEW_ELEMENTS_JS)
        seen = len(cdp.events)
        await cdp.type_and_send("show me some HTML")
        paused = await cdp.wait_event("Fetch.requestPaused", seen)
        await cdp.send("Fetch.fulfillRequest", requestId=paused["params"]["requestId"], responseCode=200,
                       responseHeaders=[{"name": "Content-Type", "value": "text/event-stream"}],
                       body=base64.b64encode(_sse_body(HOSTILE).encode()).decode())
        await cdp.wait_for("!!document.querySelector('.msg.assistant[data-done=\"1\"]')")
        await asyncio.sleep(0.3)  # time for an image's onerror or a frame's load to fire
        return await cdp.js("""(() => {
          const a = document.querySelector('.msg.assistant .text');
          return {text: a.textContent, events: Number(a.parentNode.dataset.events), pwned: window.__pwned ?? null,
                  added: window.__added, tags: [...a.querySelectorAll('*')].map((e) => e.nodeName),
                  links: [...a.querySelectorAll('a')].map((e) => e.getAttribute('href'))};
        })()""")


@needs_chromium
def test_html_in_an_answer_shows_as_text_and_runs_nothing(browser, stack):
    got = asyncio.run(_hostile_answer(browser, stack.http_url))
    assert got["events"] >= 10  # re-rendered as it streamed, half-open tags included
    assert got["pwned"] is None
    dangerous = {"IMG", "SCRIPT", "SVG", "svg", "IFRAME", "A"}
    assert not dangerous & set(got["added"]), got["added"]  # not even for one event
    assert set(got["tags"]) == {"P", "STRONG", "UL", "LI", "PRE", "CODE"}, got["tags"]
    for literal in ('<img src=x onerror="window.__pwned=1">', "<script>window.__pwned=2</script>",
                    '<iframe src="javascript:window.__pwned=4"></iframe>', "[click](javascript:window.__pwned=5)",
                    '<img src=y onerror="window.__pwned=6">'):
        assert literal in got["text"]


def test_page_never_parses_strings_as_html():
    """The renderer builds nodes; no API on the page turns a string into markup."""
    script = PAGE.read_text()
    for api in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "DOMParser",
                "createContextualFragment", "srcdoc", "eval(", "Function("):
        assert api not in script, api


# ---- Stop, and a message sent before the model list loads -------------------------------------

async def _stop_midway(browser: Browser, base: str) -> dict[str, Any]:
    async with open_page(browser, base) as cdp:
        await _ready(cdp)
        # Slow the page's reading of the stream (about 12 events a second), so that Stop lands
        # midway however fast the model is.
        await cdp.send("Network.emulateNetworkConditions", offline=False, latency=0,
                       downloadThroughput=2500, uploadThroughput=-1)
        try:
            await cdp.type_and_send("Once upon a time there was a dragon")  # 160 tokens, as in the first test
            await cdp.wait_for("Number(document.querySelector('.msg.assistant').dataset.events) >= 3")
            await cdp.js("document.querySelector('#stop').click()")
            await cdp.wait_for("!!document.querySelector('.msg.assistant[data-done=\"1\"]')")
            got = await cdp.js(LAST_ANSWER_JS)
            await asyncio.sleep(0.5)  # nothing more arrives
            got["later"] = await cdp.js(LAST_ANSWER_JS)
            got["send_shown"] = await cdp.js("!document.querySelector('#send').hidden"
                                             " && document.querySelector('#stop').hidden")
        finally:
            await cdp.send("Network.emulateNetworkConditions", offline=False, latency=0, downloadThroughput=-1,
                           uploadThroughput=-1)
        return got


@needs_chromium
def test_stop_keeps_the_partial_answer_and_its_token_count(browser, stack):
    got = asyncio.run(_stop_midway(browser, stack.http_url))
    assert got["text"] and got["stored"], got  # the partial answer stays, and in the conversation
    assert got["text"] == got["rendered"] and got["later"]["text"] == got["text"], got
    match = STOPPED.fullmatch(got["stats"])
    assert match, got["stats"]
    assert int(match[1]) >= got["events"] >= 3, got  # every text event carries at least one token
    assert got["send_shown"]


async def _send_before_models(browser: Browser, base: str) -> dict[str, Any]:
    async with open_page(browser, base, intercept=("*/v1/models*",)) as cdp:
        paused = await cdp.wait_event("Fetch.requestPaused")  # the page asked; the answer waits
        await cdp.wait_for("!!document.querySelector('#prompt')")
        await cdp.js(f"document.querySelector('#max-tokens').value = '{MAX_TOKENS}';"
                     "document.querySelector('#temperature').value = '0'")
        await cdp.type_and_send("Once upon a time")
        await asyncio.sleep(0.2)
        before = await cdp.js("""({prompt: document.querySelector('#prompt').value,
                                   bubbles: document.querySelectorAll('.msg').length,
                                   notice: document.querySelector('#notice')?.textContent ?? null})""")
        assert before["prompt"] == "Once upon a time" and before["bubbles"] == 0, before  # kept, not sent
        assert "waiting for the model list" in before["notice"], before
        await cdp.send("Fetch.continueRequest", requestId=paused["params"]["requestId"])
        await cdp.wait_for("!!document.querySelector('.msg.assistant[data-done=\"1\"]')")
        after = await cdp.js("""({prompt: document.querySelector('#prompt').value,
                                  user: document.querySelector('.msg.user').textContent,
                                  notice: document.querySelector('#notice')?.textContent ?? null})""")
        return {"after": after, "answer": await cdp.js(LAST_ANSWER_JS)}


@needs_chromium
def test_a_message_sent_before_the_models_load_waits_and_goes(browser, stack):
    got = asyncio.run(_send_before_models(browser, stack.http_url))
    assert got["after"] == {"prompt": "", "user": "Once upon a time", "notice": ""}, got
    assert got["answer"]["stored"] and STATS.fullmatch(got["answer"]["stats"]), got
