"""Decode worker: loads prompt KV from the KV store and decodes many requests in one batch."""
