"""What the chat page at GET / keeps, in a real browser (headless chromium over the DevTools
Protocol, as tests/test_chat_page.py): conversations (create, switch, rename, delete; a reload keeps
them), each with its system prompt (sent first; the answer equals the API's for the same messages),
the one chat of the page before migrated; accessible names on every control; errors (a 429's
Retry-After, an error event mid-stream, HTML in an error or a title shown as text), a model picker for
two models, and a 401 answered by asking for a key. The 429, the stream error and the second model
are the gateway's answers replaced through the DevTools Fetch domain; everything else is the real
stack's (one per module, API keys on: chat_page_support). Skipped, with the reason, when
/usr/bin/chromium is absent (scripts/ensure-chromium.sh installs it).
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import openai

from browser import CDP, Browser, needs_chromium, open_page
from chat_page_support import (BUBBLES_JS, CHAT_JS, DONE_JS, KEY, LAST_ANSWER_JS, MODEL, STATS,
                               page, ready, sent, sse_body, reload_page)
from chat_page_support import browser, client, stack  # noqa: F401 (the module-scoped fixtures)


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
        await ready(cdp, max_tokens=SHORT)
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
        got["sent"] = sent(cdp, seen)
        got["answer"] = await cdp.js(LAST_ANSWER_JS)
        messages = [{"role": "system", "content": system}, {"role": "user", "content": "Once upon a time"}]
        got["api"] = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=SHORT,
                                                    temperature=0).choices[0].message.content
        second = await _view(cdp)

        await _click_chat(cdp, "Tom had a dog.")  # titled by its first message's first line
        got["back"] = await _view(cdp)
        await _click_chat(cdp, "Once upon a time")
        got["again"] = await _view(cdp)
        await reload_page(cdp)
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
        await reload_page(cdp)
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
        await ready(cdp)  # the key came along: the model list loaded
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
        await ready(cdp)
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
    events = sse_body(text, pieces=4).split("\n\n")[:5]  # role, then four text events
    return "\n\n".join(events) + "\n\n" + f"data: {json.dumps(BROKEN)}\n\n"


async def _errors(browser: Browser, base: str) -> dict[str, Any]:
    async with page(browser, base, intercept=("*/v1/chat/completions",)) as cdp:
        await ready(cdp)
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
        await reload_page(cdp)
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
        await ready(cdp, max_tokens=SHORT)
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
        got["sent"] = [b["model"] for b in sent(cdp, seen)]
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
        await ready(cdp, max_tokens=SHORT)
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
