"""The chat page at GET / in a real browser: Debian's headless chromium, driven over the Chrome
DevTools Protocol with aiohttp's websocket client (no npm package, no downloaded browser).

One stack serves the module, with API keys on (chat_page_support). It types a message, watches the
answer stream in, and checks the answer equals what the API returns for the same greedy request,
that TTFT and tokens/s are shown, that a second turn sends the whole conversation, that Regenerate
replaces the last answer by resending the conversation up to the last user message, and that the
page fetched nothing but the gateway's own URLs. Then the page's Markdown renderer: fixed strings
become the expected elements, and HTML in an answer (also streamed, in pieces) shows as text and
runs nothing. Stop (Escape) keeps the partial answer with its token count, and a message sent before
the model list loads waits in the box and then goes. What the page keeps (conversations, errors,
models, the API key): tests/test_chat_page_conversations.py.
The browser tests are skipped, with the reason, when /usr/bin/chromium is absent
(scripts/ensure-chromium.sh installs it).
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import openai

from browser import Browser, needs_chromium
from chat_page_support import (BUBBLES_JS, CHAT_JS, DONE_JS, LAST_ANSWER_JS, MAX_TOKENS, MODEL, PAGE, STATS, STOPPED,
                               page, ready, chat_turn, sent, check_answer, sse_body, reload_page)
from chat_page_support import browser, client, stack  # noqa: F401 (the module-scoped fixtures)


async def _two_turns_and_regenerate(browser: Browser, base: str, client: openai.OpenAI) -> None:
    async with page(browser, base) as cdp:
        await ready(cdp)
        assert (await cdp.js("document.querySelector('#model').textContent")).startswith(MODEL)
        assert await cdp.js("document.querySelector('#model-choice').hidden")  # one model: no picker
        conversation: list[dict[str, str]] = []
        for turn, text in enumerate(["Once upon a time there was a dragon", "What did the dragon eat?"], 1):
            answer, trace = await chat_turn(cdp, text, turn)
            conversation.append({"role": "user", "content": text})
            api = client.chat.completions.create(model=MODEL, messages=conversation, max_tokens=MAX_TOKENS,
                                                 temperature=0)
            check_answer(answer, api, trace)
            assert sent(cdp)[-1]["messages"] == conversation
            conversation.append({"role": "assistant", "content": answer["stored"]})

        # Regenerate, under the last answer only: the conversation up to the last user message goes
        # again, and the new answer takes the old one's place (greedy: the same text).
        assert await cdp.js("document.querySelectorAll('#regenerate').length === 1 && "
                            "document.querySelector('.msg.assistant:last-of-type #regenerate') !== null")
        seen = len(cdp.events)
        await cdp.js("window.__trace.length = 0; document.querySelector('#regenerate').click()")
        await cdp.wait_for(f"{DONE_JS} === 2 && !!document.querySelector('#regenerate')")
        assert [m["messages"] for m in sent(cdp, seen)] == [conversation[:3]]
        check_answer(await cdp.js(LAST_ANSWER_JS), api, await cdp.js("window.__trace"))
        assert [m["content"] for m in (await cdp.js(CHAT_JS))["messages"]] == [m["content"] for m in conversation]
        assert len(await cdp.js(BUBBLES_JS)) == 4

        urls = {e["params"]["request"]["url"] for e in cdp.events if e["method"] == "Network.requestWillBeSent"}
        assert urls and all(u.startswith(base + "/") for u in urls), urls


@needs_chromium
def test_chat_page_streams_matches_the_api_and_regenerates(browser, stack, client):  # chromium boots as the stack starts
    asyncio.run(_two_turns_and_regenerate(browser, stack.http_url, client))


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
    async with page(browser, base) as cdp:
        await ready(cdp)
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


async def _hostile_answer(browser: Browser, base: str) -> dict[str, Any]:
    async with page(browser, base, intercept=("*/v1/chat/completions",)) as cdp:
        await ready(cdp)
        await cdp.js(NEW_ELEMENTS_JS)
        seen = len(cdp.events)
        await cdp.type_and_send("show me some HTML")
        paused = await cdp.wait_event("Fetch.requestPaused", seen)
        await cdp.fulfil(paused, 200, sse_body(HOSTILE), {"Content-Type": "text/event-stream"})
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
    """The renderer builds nodes; no API on the page turns a string into markup or code, and the
    one attribute that could carry a URL from the model's text is set in one place (the Markdown
    link, kept only for http(s)). Titles, errors and messages go in as text (textContent, or
    strings given to append(), which makes text nodes)."""
    script = PAGE.read_text()
    for api in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "DOMParser", "setHTML",
                "parseHTMLUnsafe", "createContextualFragment", "srcdoc", "eval(", "Function(", "setTimeout(\"",
                "location.href", "window.open"):
        assert api not in script, api
    assert len(re.findall(r"\.href\s*=", script)) == 1
    assert not re.search(r"setAttribute\(\s*[\"'](href|src|on\w+)", script)
    assert not re.search(r"[?&](api_?key|key|token)=", script)  # the key goes in a header, never a URL


# ---- Stop, and a message sent before the model list loads -------------------------------------

async def _stop_midway(browser: Browser, base: str) -> dict[str, Any]:
    async with page(browser, base) as cdp:
        await ready(cdp)
        # Slow the page's reading of the stream (about 12 events a second), so that Stop lands
        # midway however fast the model is.
        await cdp.send("Network.emulateNetworkConditions", offline=False, latency=0,
                       downloadThroughput=2500, uploadThroughput=-1)
        try:
            await cdp.type_and_send("Once upon a time there was a dragon")  # 160 tokens, as in the first test
            await cdp.wait_for("Number(document.querySelector('.msg.assistant').dataset.events) >= 3")
            got = {"labels": await cdp.js("[...document.querySelectorAll('#stop, #send')].map((b) => "
                                          "[b.textContent, b.getAttribute('aria-keyshortcuts')])")}
            await cdp.press("Escape")  # the same as the Stop button
            await cdp.wait_for("!!document.querySelector('.msg.assistant[data-done=\"1\"]')")
            got |= await cdp.js(LAST_ANSWER_JS)
            await asyncio.sleep(0.5)  # nothing more arrives
            got["later"] = await cdp.js(LAST_ANSWER_JS)
            got["send_shown"] = await cdp.js("!document.querySelector('#send').hidden"
                                             " && document.querySelector('#stop').hidden")
        finally:
            await cdp.send("Network.emulateNetworkConditions", offline=False, latency=0, downloadThroughput=-1,
                           uploadThroughput=-1)
        await reload_page(cdp)
        got["reloaded"] = await cdp.js(LAST_ANSWER_JS)
        return got


@needs_chromium
def test_stop_keeps_the_partial_answer_and_its_token_count(browser, stack):
    got = asyncio.run(_stop_midway(browser, stack.http_url))
    assert got["labels"] == [["Send", "Enter"], ["Stop", "Escape"]], got
    assert got["text"] and got["stored"], got  # the partial answer stays, and in the conversation
    assert got["text"] == got["rendered"] and got["later"]["text"] == got["text"], got
    match = STOPPED.fullmatch(got["stats"])
    assert match, got["stats"]
    assert int(match[1]) >= got["events"] >= 3, got  # every text event carries at least one token
    assert got["send_shown"]
    # A reload shows the same stopped answer with the same count: never "0 tokens" for text that came.
    assert (got["reloaded"]["text"], got["reloaded"]["stats"]) == (got["text"], got["stats"]), got


async def _send_before_models(browser: Browser, base: str) -> dict[str, Any]:
    async with page(browser, base, intercept=("*/v1/models*",)) as cdp:
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
