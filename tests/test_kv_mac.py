"""KV cache poisoning, against a real stack: a forged or re-labelled block is never used.

One stack for the module (1 prefill, 1 decode, a real redis-server as the kvstore's second tier)
started with `pdserve up`'s defaults: a generated internal token for every child and a generated
KV MAC key for the workers. The attacker holds the internal token but not the MAC key (the
strongest outsider short of a worker), or writes straight into Redis. It stores blocks under the
hashes of a victim prompt before the victim asks: a genuine block of another prompt re-labelled,
random KV with a valid crc32, KV signed with a key of its own. The victim's greedy output must
still equal the in-process engine's, with no token of its prompt taken from the store, and the
workers' pdserve_kv_blocks_rejected_total{reason="mac"} must count the refusals.
"""

from __future__ import annotations

import re
import urllib.request

import grpc
import pytest
import redis
import torch

from kvstore.redis_tier import block_key
from waiting import wait_until
from pdserve import internal_auth, kv_mac
from pdserve.ports import free_port, port_in_use
from pdserve.kvwire import encode_block
from pdserve.runtime.kv_format import KVFormat
from pdserve.runtime.block_hash import prompt_block_hashes
from pdserve.runtime.engine import Engine
from pdserve.runtime.loader import load_checkpoint, resolve_model_path
from pdserve.runtime.sampling_params import SamplingParams
from pdserve.stack import start_stack
from pdserve.v1 import common_pb2, gateway_pb2, kvstore_pb2
from redis_fixture import redis_server_module  # noqa: F401 (fixture)

BLOCK = 16
DONOR = ("The cat sat on the warm mat in the sun and purred. She liked the sun very much. One day a "
         "little bird came to the window and sang a song for the cat, and the cat")
VICTIM = ("Tom went to the park with his mom. He saw a big red ball under a tall tree. He ran to the ball "
          "and kicked it very hard. The ball flew over the fence and his mom")
VICTIM_REDIS = ("Lily had a little garden behind her house. Every day she gave water to the flowers and the "
                "small green plants. One morning she saw a tiny frog sitting on a leaf, and she")


def _consecutive_free_ports(count: int) -> int:
    """A base port with `count` free ports from it (the stack's --metrics-port-base)."""
    for _ in range(50):
        base = free_port()
        if base + count < 65536 and all(port_in_use("127.0.0.1", base + i) is None for i in range(count)):
            return base
    raise RuntimeError(f"no {count} consecutive free ports found")


@pytest.fixture(scope="module")
def stack(redis_server_module):  # noqa: F811
    base = _consecutive_free_ports(4)  # kvstore, prefill-0, decode-0, gateway
    s = start_stack(1, 1, "--internal-token", "--kv-backend", redis_server_module.url,
                    "--metrics-port-base", str(base))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def model():
    checkpoint = load_checkpoint(resolve_model_path(None))
    engine = Engine.from_checkpoint(checkpoint)
    c = checkpoint.config
    spec = KVFormat(checkpoint.fingerprint, torch.float32, c.num_layers, c.num_kv_heads, c.head_dim, BLOCK)

    def reference(ids: list[int], max_tokens: int) -> list[int]:
        return engine.generate([ids], SamplingParams(max_tokens=max_tokens, temperature=0))[0].output_ids
    return checkpoint, spec, reference


def _env(stack, name: str) -> dict[str, str]:
    return dict(stack.child(name).spec.env)


def _token_md(stack) -> tuple[tuple[str, str], ...]:
    return ((internal_auth.METADATA_KEY, _env(stack, "kvstore")[internal_auth.TOKEN_ENV]),)


def _hashes(checkpoint, prompt: str) -> tuple[list[int], list[bytes]]:
    ids = checkpoint.tokenizer.encode(prompt)
    return ids, prompt_block_hashes(ids, BLOCK, checkpoint.fingerprint, "float32")


def _generate(stack, prompt: str, max_tokens: int = 24) -> tuple[list[int], int]:
    """Greedy token ids through the gateway, and the prompt tokens it took from the store."""
    chunks = list(stack.gateway_stub().Generate(gateway_pb2.GenerateRequest(
        prompt=prompt, sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0)), timeout=120))
    return [t for c in chunks for t in c.token_ids], chunks[-1].usage.cached_tokens


def _rejected_mac(stack) -> float:
    """pdserve_kv_blocks_rejected_total{reason="mac"} summed over the prefill and decode workers."""
    total = 0.0
    for name in ("prefill-0", "decode-0"):
        port = _env(stack, name)["PDSERVE_METRICS_PORT"]
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        found = re.search(r'^pdserve_kv_blocks_rejected_total\{reason="mac"\} (\S+)$', text, re.M)
        assert found, f"{name} does not export pdserve_kv_blocks_rejected_total"
        total += float(found.group(1))
    return total


def _forgeries(stack, checkpoint, spec: KVFormat, count: int) -> list[bytes]:
    """`count` blocks an attacker without the MAC key can make: a genuine block of another prompt
    (read back from the store with the token), random KV with a valid crc32, KV under its own key."""
    _generate(stack, DONOR, 4)  # the donor's genuine, signed blocks are now in the store
    _, donor_hashes = _hashes(checkpoint, DONOR)
    with grpc.insecure_channel(stack.child("kvstore").spec.address) as ch:
        got = list(stack.kvstore_stub(ch).GetBlocks(kvstore_pb2.GetBlocksRequest(
            block_hashes=donor_hashes[:1]), timeout=30, metadata=_token_md(stack)))
    assert len(got) == 1 and got[0].data, "the donor's block is not in the store"
    gen = torch.Generator().manual_seed(7)
    own_key = b"attacker-key-0123456789"
    kinds = [got[0].data,
             encode_block(torch.randn(spec.shape, generator=gen), spec, BLOCK),
             encode_block(torch.randn(spec.shape, generator=gen), spec, BLOCK, b"h" * 16, own_key)]
    return [kinds[i % len(kinds)] for i in range(count)]


def _wait_for_log(stack, fragment: str, timeout_s: float = 30) -> list[str]:
    def lines() -> list[str]:
        return [line for name in ("prefill-0", "decode-0") for line in stack.child(name).tail]
    if not wait_until(lambda: any(fragment in line for line in lines()), timeout_s):
        pytest.fail(f"no worker logged {fragment!r}")
    return lines()


def test_up_generates_the_token_and_gives_the_mac_key_to_workers_only(stack):
    token = _env(stack, "kvstore")[internal_auth.TOKEN_ENV]
    assert len(token) >= 32
    for name in ("kvstore", "prefill-0", "decode-0", "gateway"):
        env = _env(stack, name)
        assert env[internal_auth.TOKEN_ENV] == token, name
        assert (kv_mac.KEY_ENV in env) == (name in ("prefill-0", "decode-0")), name
    assert _env(stack, "prefill-0")[kv_mac.KEY_ENV] == _env(stack, "decode-0")[kv_mac.KEY_ENV]


def test_kvstore_refuses_a_call_without_the_generated_token(stack, model):
    checkpoint, _, _ = model
    _, hashes = _hashes(checkpoint, VICTIM)
    with grpc.insecure_channel(stack.child("kvstore").spec.address) as ch:
        stub = stack.kvstore_stub(ch)
        with pytest.raises(grpc.RpcError) as err:
            stub.PutBlocks(iter([kvstore_pb2.PutBlockRequest(block_hash=hashes[0], data=b"x")]), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert internal_auth.TOKEN_ENV in err.value.details()
        stub.Lookup(kvstore_pb2.LookupRequest(block_hashes=hashes), timeout=10, metadata=_token_md(stack))


def test_blocks_forged_by_a_token_holder_are_never_used(stack, model):
    checkpoint, spec, reference = model
    ids, hashes = _hashes(checkpoint, VICTIM)
    assert len(hashes) >= 3
    forged = _forgeries(stack, checkpoint, spec, len(hashes))
    with grpc.insecure_channel(stack.child("kvstore").spec.address) as ch:
        put = stack.kvstore_stub(ch).PutBlocks(iter([kvstore_pb2.PutBlockRequest(block_hash=h, data=d)
                                                     for h, d in zip(hashes, forged)]),
                                               timeout=30, metadata=_token_md(stack))
    assert put.stored == len(hashes)  # the store cannot tell: it never holds the key
    before = _rejected_mac(stack)
    got, cached = _generate(stack, VICTIM)
    assert got == reference(ids, 24)
    assert cached == 0  # not one forged token of the prompt was reused
    assert _rejected_mac(stack) - before >= len(hashes)
    lines = _wait_for_log(stack, "rejected (mac")
    key = _env(stack, "decode-0")[kv_mac.KEY_ENV]
    assert not any(key in line for line in lines)


def test_blocks_written_straight_into_redis_are_never_used(stack, model, redis_server_module):  # noqa: F811
    checkpoint, spec, reference = model
    ids, hashes = _hashes(checkpoint, VICTIM_REDIS)
    forged = _forgeries(stack, checkpoint, spec, len(hashes))
    r = redis.Redis(port=redis_server_module.port)
    for h, d in zip(hashes, forged):  # what survives a kvstore restart: Redis refills it
        r.set(block_key(h), d)
    r.close()
    before = _rejected_mac(stack)
    got, cached = _generate(stack, VICTIM_REDIS)
    assert got == reference(ids, 24)
    assert cached == 0
    assert _rejected_mac(stack) - before >= len(hashes)
