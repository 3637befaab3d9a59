"""The reference reading of a model's answer for tool calls, as vLLM's Hermes parser does it (a regex
and json on the whole text): what gateway.http.tool_calls' streaming parser is compared with."""

from __future__ import annotations

import json
import re


def reference(text: str) -> tuple[str | None, list[tuple[str, object]]]:
    """Content and (name, arguments) by a regex and json (what vLLM's Hermes parser does)."""
    calls = [json.loads(body) for body in re.findall(r"<tool_call>(.*?)</tool_call>", text, re.DOTALL)]
    content = re.sub(r"<tool_call>.*?</tool_call>", "", text, flags=re.DOTALL)
    if calls:
        content = content.rstrip() or None
    return content, [(c["name"], c.get("arguments", {})) for c in calls]
