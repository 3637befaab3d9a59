"""What logs may say about a request's content: nothing, unless a debug flag says so.

Prompts, chat messages, feedback comments and generated text are the users' data, and API keys
and URL passwords are credentials; none of them belongs in a log by default (logs are shipped,
kept and read by more people than the API's clients). Every log line that could carry user text
passes it through `content`, which returns a placeholder naming its length unless the caller's
config says content may be shown (the gateway's `log_prompts`: --log-prompts or
PDSERVE_LOG_PROMPTS=1, for a debugging session). Credentials never go into a log, whatever the flag: `url` drops the password
of a URL. API keys are never logged at all (`gateway.auth` names keys by their `name=`).
"""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

LOG_PROMPTS_ENV = "PDSERVE_LOG_PROMPTS"


def content(text: str, shown: bool = False, limit: int = 500) -> str:
    """`text` (cut to `limit` characters) when `shown` (content logging is on), else
    "<N chars hidden>"; hidden unless asked, so a caller without the setting leaks nothing."""
    if shown:
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
