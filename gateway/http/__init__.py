"""The gateway's OpenAI-compatible HTTP/SSE API and its chat page, on the gRPC server's event loop.

    POST /v1/chat/completions, POST /v1/completions   (stream or whole; OpenAI's shapes)
    POST /v1/feedback                                 (a client's score of a request, for A/B experiments)
    GET  /v1/models, /v1/models/{id}, /v1/experiments, /health, /metrics, /   (the chat page)
    POST /tokenize, /detokenize; GET /version         (vLLM's utility endpoints)

Modules: `app` (routes, server start/stop), `handlers` (endpoints over the `deployments.Catalog`),
`openai_schema` (OpenAI request JSON -> the gateway's dataclasses), `openai_responses` (OpenAI
response JSON), `sse` (event framing),
`errors` (OpenAI error JSON, one status mapping), `tools` (tool calling), `utility` (tokenize,
detokenize, version), `cors` (--allowed-origins), `static/index.html` (the page).
See docs/http-api.md and docs/http-surface.md.

Nothing is imported here: `cors` serves the command line's flags (every `pdserve` command builds
them), which must not import the app and what it needs (torch among it) in a process that does not
serve HTTP, the KV store's.
"""
