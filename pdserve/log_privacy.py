"""What logs may say about a request's content: nothing, unless a debug flag says so.

Prompts, chat messages, feedback comments and generated text are the users' data, and API keys
and URL passwords are credentials; none of them belongs in a log by default (logs are shipped,
kept and read by more people than the API's clients). Every log line that could carry user text
passes it through `content`, which returns a placeholder naming its length unless
PDSERVE_LOG_PROMPTS=1 (read once per process; `use` for tests) turns content logging on for a
debugging session. Credentials never go into a log, whatever the flag: `url` drops the password
of a URL. API keys are never logged at all (`gateway.auth` names keys by their `name=`).
"""

from __future__ import annotations

import os
from urllib.parse import urlsplit, urlunsplit

LOG_PROMPTS_ENV = "PDSERVE_LOG_PROMPTS"

_enabled: bool | None = None


def prompts_logged() -> bool:
    """True when PDSERVE_LOG_PROMPTS=1: logs may show request content (debugging only)."""
    global _enabled
    if _enabled is None:
        _enabled = os.environ.get(LOG_PROMPTS_ENV, "").strip().lower() in ("1", "true", "yes", "on")
    return _enabled


def use(enabled: bool | None) -> None:
    """Turn content logging on or off for this process (None: read the environment again)."""
    global _enabled
    _enabled = enabled


def content(text: str, limit: int = 500) -> str:
    """`text` (cut to `limit` characters) when content logging is on, else "<N chars hidden>"."""
    if prompts_logged():
        return text[:limit]
    return f"<{len(text)} chars hidden; {LOG_PROMPTS_ENV}=1 shows them>"


def url(value: str) -> str:
    """`value` without the password of its userinfo (redis://:secret@host -> redis://:***@host)."""
    parts = urlsplit(value)
    if parts.password is None:
        return value
    userinfo, _, hostport = parts.netloc.rpartition("@")
    user = userinfo.partition(":")[0]
    return urlunsplit((parts.scheme, f"{user}:***@{hostport}", parts.path, parts.query, parts.fragment))
