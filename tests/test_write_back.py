"""The decode worker's write-back (decode.write_back) against a real kvstore on loopback, with the real
servicers and engines (stories260K): after concurrent decodes every full block of each sequence (prompt
and generated tokens) is in the store, under the hash chain the engine names it by, the blocks that
filled while a write was in flight went out together (fewer writes than blocks), and no block reached
the store twice: the prompt blocks a prefill worker put are skipped without asking the store, those a
sequence prefilled on the decode worker found there are skipped after asking it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import torch

from conftest import STORIES_GGUF
from decode.service import DecodeServicer
from kvstore.client import KVStoreClient
from kvstore.server import serve
from pdserve.runtime.async_engine import AsyncEngine
from pdserve.runtime.config import CacheConfig, EngineConfig
from pdserve.runtime.engine import Engine
from pdserve.runtime.loader import load_checkpoint
from pdserve.v1 import common_pb2, worker_pb2
from pdserve.worker_common import TransferCounters, Worker
from prefill.service import PrefillServicer

BS = 16
STREAMS = 8
NEW_TOKENS = 3 * BS  # each sequence fills 3 blocks past its prompt's


def _worker(checkpoint, kv_address: str, name: str) -> Worker:
    engine = Engine.from_checkpoint(checkpoint, EngineConfig(cache=CacheConfig(num_blocks=128, block_size=BS)))
    return Worker(name, AsyncEngine(engine, batch_window_s=0).start(), KVStoreClient(kv_address, timeout_s=30),
                  engine.kv_format, TransferCounters())


async def _decode(prefiller: PrefillServicer, decoder: DecodeServicer, prompt: list[int], rid: str) -> list[int]:
    sampling = common_pb2.SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    done = await prefiller.Prefill(worker_pb2.PrefillRequest(request_id=rid, token_ids=prompt, sampling=sampling), None)
    request = worker_pb2.DecodeRequest(request_id=rid, prompt_token_ids=prompt, first_token=done.first_token,
                                       block_hashes=done.block_hashes, sampling=sampling)
    tokens = [done.first_token]
    async for chunk in decoder.Decode(request, None):
        tokens.extend(chunk.token_ids)
    return tokens


@asynccontextmanager
async def _kvstore_and_workers(checkpoint) -> AsyncIterator[tuple[Worker, Worker]]:
    """A kvstore on loopback and a prefill and a decode worker using it."""
    server, port = await serve("127.0.0.1:0", 64 << 20)
    prefill = _worker(checkpoint, f"127.0.0.1:{port}", "prefill")
    decode = _worker(checkpoint, f"127.0.0.1:{port}", "decode")
    try:
        yield prefill, decode
    finally:
        for w in (prefill, decode):
            await w.kv.close()
            w.aengine.stop()
        await server.stop(None)


async def _local_decode(decoder: DecodeServicer, prompt: list[int], rid: str) -> list[int]:
    sampling = common_pb2.SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    request = worker_pb2.DecodeRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling, local_prefill=True)
    return [t async for chunk in decoder.Decode(request, None) for t in chunk.token_ids]


def test_every_filled_block_is_written_back_and_concurrent_fills_go_out_together():
    torch.set_num_threads(1)
    checkpoint = load_checkpoint(STORIES_GGUF)
    words = checkpoint.tokenizer.encode("Once upon a time, there was a little girl named Lily who loved to")
    prompts = [(words * 4)[i:i + 2 * BS + 3] for i in range(STREAMS)]  # 2 full blocks and a partial one each

    async def scenario() -> tuple[list[bool], int, int]:
        async with _kvstore_and_workers(checkpoint) as (prefill, decode):
            decoder = DecodeServicer(decode, write_back=True)
            outputs = await asyncio.gather(*(_decode(PrefillServicer(prefill), decoder, p, f"r{i}")
                                             for i, p in enumerate(prompts)))
            fmt = decode.kv_format
            chains = [fmt.reusable_hashes(p + out) for p, out in zip(prompts, outputs)]
            generated = [h for chain in chains for h in chain[2:]]  # the blocks past the prompts' two
            await asyncio.wait_for(_written(decoder), 30)
            present = await decode.kv.presence([h for chain in chains for h in chain])
            stats = await decode.kv.stats()
            queue = decoder.write_queue
            return present, len(set(generated)), queue.writes, queue.lookups, stats

    present, generated_blocks, writes, lookups, stats = asyncio.run(scenario())
    assert all(present)  # the prompts' blocks (put by prefill) and every generated one
    assert generated_blocks >= STREAMS * 2  # (the last block's final token has no KV yet)
    assert writes < generated_blocks, f"blocks that filled together were written one by one ({writes} writes)"
    assert lookups == 0, "the store was asked about blocks a prefill worker named or this worker generated"
    assert stats.bytes_in == stats.used_bytes, "a block reached the store twice"


def test_a_sequence_prefilled_on_the_decode_worker_writes_only_the_blocks_the_store_lacks():
    """A next turn prefilled here (a placement that keeps a conversation on the worker holding it):
    the prompt's first blocks are in the store (a prefill worker put them for the earlier request)
    and in this worker's paged cache, its last ones are computed here; those and the generated ones
    are written back, the ones the store held are not sent again."""
    torch.set_num_threads(1)
    checkpoint = load_checkpoint(STORIES_GGUF)
    words = checkpoint.tokenizer.encode("Once upon a time, there was a little girl named Lily who loved to")
    earlier = (words * 4)[:2 * BS + 3]  # its 2 full blocks go to the store
    prompt = (words * 4)[:4 * BS + 5]  # the same 2 blocks, then 2 more and a partial one

    async def scenario() -> tuple[list[bool], int, object]:
        async with _kvstore_and_workers(checkpoint) as (prefill, decode):
            decoder = DecodeServicer(decode, write_back=True)
            await _decode(PrefillServicer(prefill), decoder, earlier, "earlier")
            await asyncio.wait_for(_written(decoder), 30)
            out = await _local_decode(decoder, prompt, "resumed")
            await asyncio.wait_for(_written(decoder), 30)
            chain = decode.kv_format.reusable_hashes(prompt + out)
            return await decode.kv.presence(chain), decoder.write_queue.lookups, await decode.kv.stats()

    present, lookups, stats = asyncio.run(scenario())
    assert len(present) >= 6 and all(present)  # 4 prompt blocks, 2+ generated
    assert lookups >= 1  # the local prefill's blocks were looked up before any data moved
    assert stats.bytes_in == stats.used_bytes, "a block the store held was sent again"


async def _written(decoder: DecodeServicer) -> None:
    """Until the write-back queue has nothing waiting and no write in flight."""
    queue = decoder.write_queue
    while queue._waiting or (queue._writer is not None and not queue._writer.done()):
        await asyncio.sleep(0.01)
