"""What the chat page's browser tests share (tests/test_chat_page.py, tests/test_chat_page_conversations.py):
the module-scoped stack (API keys on, so that the page meets a real 401), the headless chromium, the
OpenAI client the answers are compared with, the page opened with its key, and the JavaScript that
reads what the page shows and keeps."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import openai
import pytest

from browser import CDP, Browser, open_page
from conftest import start_keyed_stack

PAGE = Path(__file__).resolve().parents[1] / "gateway" / "http" / "static" / "index.html"

MODEL = "stories260K"
KEY = "sk-chat-page-6d1f"
MAX_TOKENS = 160  # long enough that the answer takes many events to arrive
STATS = re.compile(r"TTFT \d+ ms · [\d.]+ tokens/s · (\d+) tokens · (length|stop)")
STOPPED = re.compile(r"TTFT \d+ ms · [\d.]+ tokens/s · ≥ (\d+) tokens · stopped")


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = start_keyed_stack(tmp_path_factory.mktemp("keys"), f"{KEY} name=chat-page")
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


async def ready(cdp: CDP, max_tokens: int = MAX_TOKENS, temperature: float = 0.0) -> None:
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


async def chat_turn(cdp: CDP, text: str, turn: int) -> tuple[dict[str, Any], list]:
    await cdp.js("window.__trace.length = 0")
    await cdp.type_and_send(text)
    await cdp.wait_for(f"{DONE_JS} === {turn}")
    return await cdp.js(LAST_ANSWER_JS), await cdp.js("window.__trace")


def sent(cdp: CDP, after: int = 0) -> list[dict[str, Any]]:
    """The bodies of the page's chat requests, from event index `after` on."""
    return [json.loads(r["postData"]) for r in cdp.requests("/v1/chat/completions", after)]


def check_answer(answer: dict[str, Any], api: Any, trace: list) -> None:
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


def sse_body(text: str, pieces: int = 12) -> str:
    """An OpenAI chat stream of `text` in `pieces` events, as a replaced (intercepted) answer."""
    step = -(-len(text) // pieces)
    chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}]
    chunks += [{"choices": [{"index": 0, "delta": {"content": text[i:i + step]}, "finish_reason": None}]}
               for i in range(0, len(text), step)]
    chunks += [{"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
               {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 40, "total_tokens": 45}}]
    return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"


async def reload_page(cdp: CDP) -> None:
    """Reloads the page and waits until it is ready again."""
    seen = len(cdp.events)
    await cdp.send("Page.reload")
    await cdp.wait_event("Page.loadEventFired", seen)
    await cdp.wait_for("document.body && document.body.dataset.ready === '1'")
