"""The soak's load faults: requests cancelled while their prefill runs, and forged KV blocks.

    cancel-during-prefill: a burst of requests on LONG_PROMPTS (3 prefill steps each); request i
        is cancelled once the prefill workers have run i engine steps since the burst was sent, so
        the cancels land at spread points of the prefill on any machine (step counts, not time).
    poison: an insider who holds the internal token but not the KV MAC key PutBlocks random KV
        under the block hashes of a POISON_PROMPTS prompt no request has sent yet (the first
        writer of a hash wins), with a header that is valid in every other way (this model's
        fingerprint, shape, checksum); then requests on that prompt must still equal the reference.

Both record their requests in the load's LoadLog, so the ledger checks them like any other. They
run on threads of their own (`AttackLog.start`), so that the schedule's next fault does not wait
for a burst to end; the soak joins them (`AttackLog.join`) before its checks.
"""

from __future__ import annotations

import inspect
import os
import secrets
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import torch

from pdserve.internal_auth import METADATA_KEY, TOKEN_ENV
from pdserve.kvwire import encode_block
from pdserve.runtime.kv_format import KVFormat
from pdserve.soak.workload import ALL_PROMPTS, LONG_PROMPTS, POISON_PROMPTS, PROMPTS, LoadLog, RequestSpec
from pdserve.stack import Stack
from pdserve.v1 import kvstore_pb2

POISON_REQUESTS = (16, 48, 48)  # max_tokens of the requests that follow each forgery


@dataclass
class AttackLog:
    """What the load faults did, for the report."""

    prefill_cancel_bursts: int = 0
    prefill_cancels: int = 0  # requests sent by those bursts
    forged_stored: int = 0  # forged blocks the kvstore took (under hashes nobody had written)
    forged_already_present: int = 0  # forgeries refused as present: genuine KV was there first
    poisoned_prompts: list[int] = field(default_factory=list)  # indexes into ALL_PROMPTS
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _threads: list[threading.Thread] = field(default_factory=list, repr=False)

    def report(self) -> dict:
        return {k: v for k, v in vars(self).items() if not k.startswith("_")}

    def start(self, fn: Callable[..., None], *args) -> None:
        """Run `fn(*args)` on a thread of its own."""
        thread = threading.Thread(target=fn, args=args, name=f"soak-{fn.__name__}", daemon=True)
        with self._lock:
            self._threads.append(thread)
        thread.start()

    def join(self) -> None:
        """Wait for every attack started so far (their requests end by their own deadline)."""
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join()


def cancel_during_prefill(log: LoadLog, stack: Stack, attacks: AttackLog, burst: int) -> None:
    """Send `burst` long-prompt requests at once; cancel request i after i prefill steps."""
    with attacks._lock:
        n = attacks.prefill_cancel_bursts
        attacks.prefill_cancel_bursts += 1
        attacks.prefill_cancels += burst
    prompt = len(PROMPTS) + n % len(LONG_PROMPTS)
    base = prefill_steps(stack)
    specs = [RequestSpec(f"soak-pc{n:03d}-{i:02d}", prompt, 16, 0, "prefill-cancel") for i in range(burst)]
    stub = log.stub_factory()  # one channel for the burst
    threads = [threading.Thread(target=log.run, args=(spec, stub, _after_steps(stack, base + i)),
                                name=f"soak-prefill-cancel-{i}") for i, spec in enumerate(specs)]
    _run_all(threads)


def _after_steps(stack: Stack, steps: int) -> Callable[[], bool]:
    return lambda: prefill_steps(stack) >= steps


def prefill_steps(stack: Stack) -> int:
    """Engine steps run by the live prefill workers, together (a dead one counts 0)."""
    total = 0
    for child in stack.workers:
        if child.spec.name.startswith("prefill") and child.proc.poll() is None:
            try:
                total += stack.worker_stats(child.spec.name).num_steps
            except grpc.RpcError:
                pass  # killed by the schedule meanwhile
    return total


def poison(log: LoadLog, stack: Stack, attacks: AttackLog, tokenizer, spec: KVFormat, kv_dtype: str) -> None:
    """Forge the blocks of the next unused poisoned prompt, then send requests on it."""
    with attacks._lock:
        n = len(attacks.poisoned_prompts)
        prompt = len(PROMPTS) + len(LONG_PROMPTS) + n % len(POISON_PROMPTS)
        attacks.poisoned_prompts.append(prompt)
    ids = tokenizer.encode(ALL_PROMPTS[prompt])
    hashes = spec.with_kv_dtype(kv_dtype).full_block_hashes(ids)  # as the stack's workers name them
    stored, present = put_forged(stack, hashes, spec, torch.Generator().manual_seed(n))
    with attacks._lock:
        attacks.forged_stored += stored
        attacks.forged_already_present += present
    specs = [RequestSpec(f"soak-poison{n:03d}-{i:02d}", prompt, m, None, "poison")
             for i, m in enumerate(POISON_REQUESTS)]
    stub = log.stub_factory()
    _run_all([threading.Thread(target=log.run, args=(s, stub), name=f"soak-poison-{i}") for i, s in enumerate(specs)])


def put_forged(stack: Stack, hashes: list[bytes], spec: KVFormat, gen: torch.Generator) -> tuple[int, int]:
    """PutBlocks random KV under `hashes`, unpinned, as an insider would: (stored, already present)."""
    def requests():
        for h in hashes:
            kv = torch.randn(spec.shape, generator=gen).to(spec.dtype)
            yield kvstore_pb2.PutBlockRequest(block_hash=h, data=forge_encoding(kv, spec, h))
    with grpc.insecure_channel(stack.child("kvstore").spec.address) as channel:
        reply = stack.kvstore_stub(channel).PutBlocks(requests(), metadata=insider_metadata(stack), timeout=30)
    return reply.stored, reply.already_present


def forge_encoding(kv: torch.Tensor, spec: KVFormat, block_hash: bytes) -> bytes:
    """The wire encoding an insider without the cluster's KV MAC key can make: signed with a key of
    its own guessing where the wire format has a MAC (pdserve.kv_mac), valid in every other field."""
    if "mac_key" in inspect.signature(encode_block).parameters:
        return encode_block(kv, spec, spec.block_size, block_hash=block_hash, mac_key=secrets.token_bytes(32))
    return encode_block(kv, spec, spec.block_size)


def insider_metadata(stack: Stack) -> tuple[tuple[str, str], ...]:
    """The internal token the kvstore demands, when it has one: the insider holds it."""
    env = dict(stack.child("kvstore").spec.env)
    token = env.get(TOKEN_ENV) or os.environ.get(TOKEN_ENV, "")
    return ((METADATA_KEY, token),) if token else ()


def _run_all(threads: list[threading.Thread]) -> None:
    for t in threads:
        t.start()
    for t in threads:
        t.join()
