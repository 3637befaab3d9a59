"""Prefill worker: computes prompts' KV, writes its blocks to the KV store, samples token one."""
