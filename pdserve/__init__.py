"""pdserve: disaggregated LLM serving (gateway, prefill, decode, KV store)."""

__version__ = "0.1.0"
