"""The chat page at GET / in a real browser: Debian's headless chromium, driven over the Chrome
DevTools Protocol with aiohttp's websocket client (no npm package, no downloaded browser).

One stack serves the module, with API keys on, so that the page meets a real 401. It types a
message, watches the answer stream in, and checks the answer equals what the API returns for the
same greedy request, that TTFT and tokens/s are shown, that a second turn sends the whole
conversation, that Regenerate replaces the last answer by resending the conversation up to the
last user message, and that the page fetched nothing but the gateway's own URLs. Then the page's
Markdown renderer: fixed strings become the expected elements, and HTML in an answer (also
streamed, in pieces) shows as text and runs nothing. Stop (Escape) keeps the partial answer with
its token count, and a message sent before the model list loads waits in the box and then goes.
Then what the page keeps: conversations (create, switch, rename, delete; a reload keeps them),
each with its system prompt (sent first; the answer equals the API's for the same messages), the
one chat of the page before migrated; errors (a 429's Retry-After, an error event mid-stream,
HTML in an error or a title shown as text), a model picker for two models, and a 401 answered by
asking for a key. The 429, the stream error and the second model are the gateway's answers
replaced through the DevTools Fetch domain; everything else is the real stack's.
The browser tests are skipped, with the reason, when /usr/bin/chromium is absent
(scripts/ensure-chromium.sh installs it).
"""

from __future__ import annotations

import asyncio
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
KEY = "sk-chat-page-6d1f"
MAX_TOKENS = 160  # long enough that the answer takes many events to arrive
STATS = re.compile(r"TTFT \d+ ms · [\d.]+ tokens/s · (\d+) tokens · (length|stop)")
STOPPED = re.compile(r"TTFT \d+ ms · [\d.]+ tokens/s · ≥ (\d+) tokens · stopped")


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "api-keys"
    keys.write_text(f"{KEY} name=chat-page\n")
    s = start_stack(1, 1, "--http-port", str(free_port()), env={"PDSERVE_API_KEYS_FILE": str(keys)})
    yield s
    s.stop()


@pytest.fixture(scope="module")
def browser():
    b = Browser()
    yield b
    b.close()


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.http_url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def page(browser: Browser, base: str, intercept: tuple[str, ...] = (), **storage: Any):
    """The chat page with the API key already given (as a person who entered it once)."""
    return open_page(browser, base, intercept, local={"pdserve-key": KEY, **storage.pop("local", {})}, **storage)


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
# The conversation as the page keeps it (localStorage), and its newest answer as it shows it.
CHAT_JS = """(() => {
  const store = JSON.parse(localStorage.getItem('pdserve-chats'));
  return store.chats.find((c) => c.id === store.current);
})()"""
LAST_ANSWER_JS = f"""(() => {{
  const a = [...document.querySelectorAll('.msg.assistant')].pop();
  const stored = {CHAT_JS}.messages.filter((m) => m.role === 'assistant').pop();
  return {{text: a.querySelector('.text').textContent, stats: a.querySelector('.stats').textContent,
          events: Number(a.dataset.events), stored: stored && stored.content, stored_stats: stored && stored.stats,
          rendered: stored && pdserveChat.markdown(stored.content).textContent,
          paragraphs: a.querySelectorAll('.text > p').length}};
}})()"""
DONE_JS = "document.querySelectorAll('.msg.assistant[data-done=\"1\"]').length"
BUBBLES_JS = ("[...document.querySelectorAll('#log .msg')]"
              ".map((m) => [m.classList[1], m.querySelector('.text').textContent])")


async def _chat_turn(cdp: CDP, text: str, turn: int) -> tuple[dict[str, Any], list]:
    await cdp.js("window.__trace.length = 0")
    await cdp.type_and_send(text)
    await cdp.wait_for(f"{DONE_JS} === {turn}")
    return await cdp.js(LAST_ANSWER_JS), await cdp.js("window.__trace")


def _sent(cdp: CDP, after: int = 0) -> list[dict[str, Any]]:
    """The bodies of the page's chat requests, from event index `after` on."""
    return [json.loads(r["postData"]) for r in cdp.requests("/v1/chat/completions", after)]


def _check_answer(answer: dict[str, Any], api: Any, trace: list) -> None:
    # What the page keeps (and sends back next turn) is the model's text; what it shows is that
    # text's Markdown: for a story, paragraphs.
    assert answer["stored"] == api.choices[0].message.content, answer
    assert answer["text"] == answer["rendered"] and answer["paragraphs"] >= 1, answer
    match = STATS.fullmatch(answer["stats"])
    assert match and answer["stored_stats"] == answer["stats"], answer
    assert int(match[1]) == api.usage.completion_tokens
    lengths = [n for _, n in trace]
    growing = sorted(set(n for n in lengths if 0 < n < len(answer["text"])))
    assert len(growing) >= 3, f"the answer did not stream in pieces: {lengths}"


async def _two_turns_and_regenerate(browser: Browser, base: str, client: openai.OpenAI) -> None:
    async with page(browser, base) as cdp:
        await _ready(cdp)
        assert (await cdp.js("document.querySelector('#model').textContent")).startswith(MODEL)
        assert await cdp.js("document.querySelector('#model-choice').hidden")  # one model: no picker
        conversation: list[dict[str, str]] = []
        for turn, text in enumerate(["Once upon a time there was a dragon", "What did the dragon eat?"], 1):
            answer, trace = await _chat_turn(cdp, text, turn)
            conversation.append({"role": "user", "content": text})
            api = client.chat.completions.create(model=MODEL, messages=conversation, max_tokens=MAX_TOKENS,
                                                 temperature=0)
            _check_answer(answer, api, trace)
            assert _sent(cdp)[-1]["messages"] == conversation
            conversation.append({"role": "assistant", "content": answer["stored"]})

        # Regenerate, under the last answer only: the conversation up to the last user message goes
        # again, and the new answer takes the old one's place (greedy: the same text).
        assert await cdp.js("document.querySelectorAll('#regenerate').length === 1 && "
                            "document.querySelector('.msg.assistant:last-of-type #regenerate') !== null")
        seen = len(cdp.events)
        await cdp.js("window.__trace.length = 0; document.querySelector('#regenerate').click()")
        await cdp.wait_for(f"{DONE_JS} === 2 && !!document.querySelector('#regenerate')")
        assert [m["messages"] for m in _sent(cdp, seen)] == [conversation[:3]]
        _check_answer(await cdp.js(LAST_ANSWER_JS), api, await cdp.js("window.__trace"))
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
    async with page(browser, base, intercept=("*/v1/chat/completions",)) as cdp:
        await _ready(cdp)
        await cdp.js(NEW_ELEMENTS_JS)
        seen = len(cdp.events)
        await cdp.type_and_send("show me some HTML")
        paused = await cdp.wait_event("Fetch.requestPaused", seen)
        await cdp.fulfil(paused, 200, _sse_body(HOSTILE), {"Content-Type": "text/event-stream"})
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

async def _reload(cdp: CDP) -> None:
    seen = len(cdp.events)
    await cdp.send("Page.reload")
    await cdp.wait_event("Page.loadEventFired", seen)
    await cdp.wait_for("document.body && document.body.dataset.ready === '1'")


async def _stop_midway(browser: Browser, base: str) -> dict[str, Any]:
    async with page(browser, base) as cdp:
        await _ready(cdp)
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
        await _reload(cdp)
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


# ---- Conversations, each with its system prompt -----------------------------------------------

SHORT = 24  # tokens per answer where only the conversation matters
LIST_JS = """[...document.querySelectorAll('#chats li')].map((li) => ({
  title: li.querySelector('.chat-open')?.textContent, current: li.getAttribute('aria-current') === 'true'}))"""


async def _click_chat(cdp: CDP, title: str, button: str = ".chat-open") -> None:
    await cdp.js(f"""[...document.querySelectorAll('#chats li')]
      .find((li) => li.querySelector('.chat-open').textContent === {json.dumps(title)})
      .querySelector({json.dumps(button)}).click()""")


async def _view(cdp: CDP) -> dict[str, Any]:
    return await cdp.js(f"""({{bubbles: {BUBBLES_JS}, system: document.querySelector('#system').value,
                              list: {LIST_JS}}})""")


async def _conversations(browser: Browser, base: str, client: openai.OpenAI) -> dict[str, Any]:
    async with page(browser, base) as cdp:
        await _ready(cdp, max_tokens=SHORT)
        got: dict[str, Any] = {}
        # Shift+Enter is a new line, Enter sends the lot.
        await cdp.js("document.querySelector('#prompt').focus()")
        await cdp.send("Input.insertText", text="Tom had a dog.")
        await cdp.press("Enter", modifiers=8)
        await cdp.send("Input.insertText", text="The dog")
        got["typed"] = await cdp.js("[document.querySelector('#prompt').value,"
                                    " document.querySelectorAll('.msg').length]")
        await cdp.press("Enter")
        await cdp.wait_for(f"{DONE_JS} === 1")
        first = await _view(cdp)

        # A second conversation with a system prompt, typed as a person types it.
        await cdp.js("document.querySelector('#new-chat').click(); document.querySelector('#system-box').open = true;"
                     "document.querySelector('#system').focus()")
        system = "You tell short stories about cats."
        await cdp.send("Input.insertText", text=system)
        seen = len(cdp.events)
        await cdp.type_and_send("Once upon a time")
        await cdp.wait_for(f"{DONE_JS} === 1")
        got["sent"] = _sent(cdp, seen)
        got["answer"] = await cdp.js(LAST_ANSWER_JS)
        messages = [{"role": "system", "content": system}, {"role": "user", "content": "Once upon a time"}]
        got["api"] = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=SHORT,
                                                    temperature=0).choices[0].message.content
        second = await _view(cdp)

        await _click_chat(cdp, "Tom had a dog.")  # titled by its first message's first line
        got["back"] = await _view(cdp)
        await _click_chat(cdp, "Once upon a time")
        got["again"] = await _view(cdp)
        await _reload(cdp)
        got["reloaded"] = await _view(cdp)
        await _click_chat(cdp, "Tom had a dog.")
        got["reloaded_first"] = await _view(cdp)

        # Rename in place (Enter keeps it), then delete the other one (two clicks: ask, delete).
        await _click_chat(cdp, "Tom had a dog.", ".chat-rename")
        await cdp.js("document.querySelector('#chats input').select()")
        await cdp.send("Input.insertText", text="Dog story")
        await cdp.press("Enter")
        await _click_chat(cdp, "Once upon a time", ".chat-delete")
        got["asked"] = await cdp.js(LIST_JS)
        await _click_chat(cdp, "Once upon a time", ".chat-delete")
        await _reload(cdp)
        got["after_delete"] = await _view(cdp)
        got["first"], got["second"] = first, second
        return got


@needs_chromium
def test_conversations_switch_survive_a_reload_and_send_their_system_prompt(browser, stack, client):
    got = asyncio.run(_conversations(browser, stack.http_url, client))
    assert got["typed"] == ["Tom had a dog.\nThe dog", 0], got  # Shift+Enter: a new line, nothing sent
    first, second = got["first"], got["second"]
    assert [role for role, _ in first["bubbles"]] == ["user", "assistant"], first
    assert first["bubbles"][0][1] == "Tom had a dog.\nThe dog", first
    # The system prompt goes first, and the answer is the API's for the same messages.
    assert [m["role"] for m in got["sent"][0]["messages"]] == ["system", "user"], got["sent"]
    assert got["sent"][0]["messages"][0]["content"] == "You tell short stories about cats."
    assert got["answer"]["stored"] == got["api"], got
    assert second["list"] == [{"title": "Once upon a time", "current": True},
                              {"title": "Tom had a dog.", "current": False}], second["list"]
    # Switching shows each conversation's own history and system prompt, unchanged, also after a reload.
    assert got["back"]["bubbles"] == first["bubbles"] and got["back"]["system"] == "", got["back"]
    assert got["again"]["bubbles"] == second["bubbles"], got["again"]
    assert got["again"]["system"] == "You tell short stories about cats.", got["again"]
    assert got["reloaded"] == got["again"], got["reloaded"]  # the current one is the one open before
    assert got["reloaded_first"]["bubbles"] == first["bubbles"]
    assert [t["title"] for t in got["asked"]] == ["Once upon a time", "Dog story"]  # asked, not deleted yet
    assert got["after_delete"]["list"] == [{"title": "Dog story", "current": True}], got["after_delete"]
    assert got["after_delete"]["bubbles"] == first["bubbles"]


OLD_CHAT = {"user": "chat-old1234", "messages": [{"role": "user", "content": "Hi there"},
                                                 {"role": "assistant", "content": "Hello **you**"}],
            "stats": [None, "TTFT 12 ms · 50.0 tokens/s · 3 tokens · stop"]}


async def _migrated(browser: Browser, base: str) -> dict[str, Any]:
    # The page before kept one chat, and the key, in sessionStorage; nothing in localStorage.
    async with open_page(browser, base, session={"pdserve-chat": json.dumps(OLD_CHAT), "pdserve-chat-key": KEY}) as cdp:
        await _ready(cdp)  # the key came along: the model list loaded
        return {"view": await _view(cdp), "chat": await cdp.js(CHAT_JS),
                "stats": await cdp.js("document.querySelector('.msg.assistant .stats').textContent"),
                "session": await cdp.js("Object.keys(sessionStorage)"),
                "key": await cdp.js("localStorage.getItem('pdserve-key')")}


@needs_chromium
def test_the_one_chat_of_the_page_before_becomes_a_conversation(browser, stack):
    got = asyncio.run(_migrated(browser, stack.http_url))
    assert got["view"]["bubbles"] == [["user", "Hi there"], ["assistant", "Hello you"]], got
    assert got["view"]["list"] == [{"title": "Hi there", "current": True}], got
    assert got["chat"]["user"] == "chat-old1234" and got["stats"] == OLD_CHAT["stats"][1], got
    assert got["session"] == [] and got["key"] == KEY, got


async def _unnamed_controls(browser: Browser, base: str) -> tuple[list, list]:
    async with page(browser, base, session={"pdserve-chat": json.dumps(OLD_CHAT)}) as cdp:
        await _ready(cdp)
        await cdp.js("document.querySelector('#system-box').open = true")
        await cdp.send("Accessibility.enable")
        nodes = (await cdp.send("Accessibility.getFullAXTree"))["nodes"]
        controls = [(n["role"]["value"], n.get("name", {}).get("value", "")) for n in nodes
                    if not n.get("ignored") and n.get("role", {}).get("value") in CONTROL_ROLES]
        return controls, [c for c in controls if not c[1].strip()]


CONTROL_ROLES = {"button", "textbox", "combobox", "spinbutton", "checkbox", "link"}


@needs_chromium
def test_every_control_has_an_accessible_name(browser, stack):
    """As the browser's own accessibility tree names them (what a screen reader reads)."""
    controls, unnamed = asyncio.run(_unnamed_controls(browser, stack.http_url))
    assert not unnamed, controls
    names = {name for _, name in controls}
    assert {"Message", "Send", "+ New chat", "↻ Regenerate", "Rename Hi there", "Delete Hi there",
            "System prompt of this conversation", "max tokens", "temperature", "API key"} <= names, controls


# ---- Errors, shown to the person as text ----------------------------------------------------

PWN = '<img src=x onerror="window.__pwned=1">'
BUSY = {"error": {"message": f"the gateway is at --max-inflight (256) {PWN}", "type": "rate_limit_error",
                  "param": None, "code": "rate_limit_exceeded"}}
BROKEN = {"error": {"message": f"decode worker lost {PWN}", "type": "server_error", "param": None, "code": None}}


def _broken_stream(text: str) -> str:
    """An SSE body that streams `text` and then ends with an error event instead of a finish."""
    events = _sse_body(text, pieces=4).split("\n\n")[:5]  # role, then four text events
    return "\n\n".join(events) + "\n\n" + f"data: {json.dumps(BROKEN)}\n\n"


async def _errors(browser: Browser, base: str) -> dict[str, Any]:
    async with page(browser, base, intercept=("*/v1/chat/completions",)) as cdp:
        await _ready(cdp)
        got: dict[str, Any] = {}
        question = f"{PWN} tell me a story"
        seen = len(cdp.events)
        await cdp.type_and_send(question)
        paused = await cdp.wait_event("Fetch.requestPaused", seen)
        await cdp.fulfil(paused, 429, json.dumps(BUSY), {"Content-Type": "application/json", "Retry-After": "7"})
        await cdp.wait_for(f"{DONE_JS} === 1")
        got["busy"] = await cdp.js("""({warn: document.querySelector('.msg.assistant .warn').textContent,
                                        prompt: document.querySelector('#prompt').value})""")
        got["busy"]["stored"] = (await cdp.js(CHAT_JS))["messages"]

        # Sent again (the text went back in the box): this time the stream breaks midway.
        seen = len(cdp.events)
        await cdp.js("document.querySelector('#prompt').focus()")
        await cdp.press("Enter")
        paused = await cdp.wait_event("Fetch.requestPaused", seen)
        await cdp.fulfil(paused, 200, _broken_stream("Once upon a time there was a cat."),
                         {"Content-Type": "text/event-stream"})
        await cdp.wait_for(f"{DONE_JS} === 1 && !!document.querySelector('.msg.assistant .warn')")
        await asyncio.sleep(0.3)  # time for an image's onerror to fire
        warn_js = "[...document.querySelectorAll('.msg.assistant > *')].map((e) => [e.className, e.textContent])"
        got["broken"] = await cdp.js(warn_js)
        got["stored"] = (await cdp.js(CHAT_JS))["messages"]
        got["list"] = await cdp.js(LIST_JS)
        await _reload(cdp)
        got["reloaded"] = await cdp.js(warn_js)
        got["images"] = await cdp.js("document.querySelectorAll('img, b').length")
        got["pwned"] = await cdp.js("window.__pwned ?? null")
        return got


@needs_chromium
def test_errors_show_their_message_a_429_its_retry_after_and_a_broken_stream_its_partial_answer(browser, stack):
    got = asyncio.run(_errors(browser, stack.http_url))
    question = f"{PWN} tell me a story"
    assert got["busy"] == {"warn": f"⚠ busy: retry in 7 s — the gateway is at --max-inflight (256) {PWN}",
                           "prompt": question, "stored": []}, got["busy"]  # nothing kept: the text back in the box
    text, warn, stats, *rest = got["broken"]
    assert text == ["text md", "Once upon a time there was a cat."], got["broken"]
    assert rest == [["", "↻ Regenerate"]], got["broken"]  # a broken answer may be asked for again
    assert warn == ["warn", f"⚠ decode worker lost {PWN}"], got["broken"]  # under the partial answer
    match = re.fullmatch(r"TTFT \d+ ms · [\d.]+ tokens/s · ≥ (\d+) tokens · failed", stats[1])
    assert stats[0] == "stats" and match and int(match[1]) == 4, stats  # four text events: at least four tokens
    assert got["stored"] == [{"role": "user", "content": question},
                             {"role": "assistant", "content": "Once upon a time there was a cat.", "stats": stats[1],
                              "error": f"decode worker lost {PWN}"}], got["stored"]
    # Titled by the first message, cut to 48 characters: HTML in it is text there too.
    assert got["list"] == [{"title": question[:47] + "…", "current": True}], got["list"]
    assert got["reloaded"] == got["broken"], got["reloaded"]
    assert got["images"] == 0 and got["pwned"] is None, got


# ---- The model picker, and the API key --------------------------------------------------------

TWO_MODELS = {"object": "list", "data": [
    {"id": MODEL, "object": "model", "created": 0, "owned_by": "pdserve", "max_model_len": 512},
    {"id": "tinystories-big", "object": "model", "created": 0, "owned_by": "pdserve", "max_model_len": 2048}]}


async def _two_models(browser: Browser, base: str) -> dict[str, Any]:
    async with page(browser, base, intercept=("*/v1/models*",)) as cdp:
        paused = await cdp.wait_event("Fetch.requestPaused")
        await cdp.fulfil(paused, 200, json.dumps(TWO_MODELS), {"Content-Type": "application/json"})
        await _ready(cdp, max_tokens=SHORT)
        picker_js = """({shown: !document.querySelector('#model-choice').hidden,
                         options: [...document.querySelectorAll('#model-picker option')].map((o) => o.value),
                         value: document.querySelector('#model-picker').value,
                         info: document.querySelector('#model').textContent,
                         label: document.querySelector('#model-picker').labels[0].firstChild.data.trim()})"""
        got = {"first": await cdp.js(picker_js)}
        choose = ("(m) => { const p = document.querySelector('#model-picker');"
                  " p.value = m; p.dispatchEvent(new Event('change')); }")
        seen = len(cdp.events)
        await cdp.type_and_send("Tom had a dog")
        await cdp.wait_for(f"{DONE_JS} === 1")
        got["answered"] = await cdp.js(LAST_ANSWER_JS)
        # A new conversation starts with the model of the one before; this one picks the other.
        await cdp.js("document.querySelector('#new-chat').click()")
        await cdp.js(f"({choose})('tinystories-big')")
        got["chosen"] = await cdp.js(picker_js)
        await cdp.type_and_send("Once upon a time")  # the gateway serves no such model: its 404 names the one it does
        await cdp.wait_for(f"{DONE_JS} === 1")
        got["sent"] = [b["model"] for b in _sent(cdp, seen)]
        got["warn"] = await cdp.js("document.querySelector('.msg.assistant .warn').textContent")
        await _click_chat(cdp, "Tom had a dog")
        got["back"] = await cdp.js(picker_js)
        await _click_chat(cdp, "New chat")
        got["again"] = await cdp.js(picker_js)
        return got


@needs_chromium
def test_a_model_picker_for_two_models_and_a_model_per_conversation(browser, stack):
    got = asyncio.run(_two_models(browser, stack.http_url))
    assert got["first"] == {"shown": True, "options": [MODEL, "tinystories-big"], "value": MODEL,
                            "info": "512-token context", "label": "model"}, got
    assert got["answered"]["stored"] and STATS.fullmatch(got["answered"]["stats"]), got
    assert got["chosen"]["value"] == "tinystories-big" and got["chosen"]["info"] == "2048-token context", got
    assert got["sent"] == [MODEL, "tinystories-big"], got
    assert "tinystories-big" in got["warn"] and MODEL in got["warn"], got["warn"]  # the gateway's own 404
    assert (got["back"]["value"], got["again"]["value"]) == (MODEL, "tinystories-big"), got


async def _asks_for_a_key(browser: Browser, base: str) -> dict[str, Any]:
    async with open_page(browser, base) as cdp:  # no key yet
        dialog_js = """({open: document.querySelector('#key-dialog').open,
                         reason: document.querySelector('#key-reason').textContent,
                         label: document.querySelector('#api-key').labels[0].textContent.trim(),
                         focused: document.activeElement === document.querySelector('#api-key')})"""
        got = {"asked": await cdp.wait_for(f"document.querySelector('#key-dialog')?.open && {dialog_js}")}
        await cdp.send("Input.insertText", text="sk-wrong")
        await cdp.press("Enter")
        await cdp.wait_for("document.querySelector('#key-reason').textContent.includes('not valid')")
        got["wrong"] = await cdp.js(dialog_js)
        await cdp.js("document.querySelector('#api-key').select()")
        await cdp.send("Input.insertText", text=KEY)
        await cdp.press("Enter")
        await _ready(cdp, max_tokens=SHORT)
        await cdp.type_and_send("Once upon a time")
        await cdp.wait_for(f"{DONE_JS} === 1")
        got["answer"] = await cdp.js(LAST_ANSWER_JS)
        got["auth"] = [r["headers"].get("Authorization") for r in cdp.requests("/v1/chat/completions")]
        got["urls"] = [e["params"]["request"]["url"] for e in cdp.events if e["method"] == "Network.requestWillBeSent"]
        got["kept"] = await cdp.js("localStorage.getItem('pdserve-key')")
        got["closed"] = not await cdp.js("document.querySelector('#key-dialog').open")
        return got


@needs_chromium
def test_a_401_asks_for_an_api_key_and_retries_with_it(browser, stack):
    got = asyncio.run(_asks_for_a_key(browser, stack.http_url))
    asked = got["asked"]
    assert asked["open"] and asked["focused"] and asked["label"] == "API key", asked
    assert "requires an API key" in asked["reason"], asked  # the gateway's own message
    assert got["wrong"]["open"] and "not valid" in got["wrong"]["reason"], got["wrong"]
    assert got["answer"]["stored"] and STATS.fullmatch(got["answer"]["stats"]), got
    assert got["auth"] == [f"Bearer {KEY}"] and got["kept"] == KEY and got["closed"], got
    assert not [u for u in got["urls"] if "sk-" in u], got["urls"]  # never in a URL
