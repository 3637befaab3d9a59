"""The KV store service: a content-addressed cache of encoded KV blocks shared by prefill and decode.

`store` holds the blocks (pure Python), `service` exposes it over gRPC, `server` runs it,
`client` is what workers use to talk to it.
"""
