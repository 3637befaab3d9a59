"""The decode worker's write-back (decode.write_back) against a real kvstore on loopback, with the real
servicers and engines (stories260K): after concurrent decodes every full block of each sequence (prompt
and generated tokens) is in the store, under the hash chain the engine names it by, the blocks that
filled while a write was in flight went out together (fewer writes than blocks), a filled block
waits for a batch, its sequence's end or the queue's longest wait (not a write each), and no block reached
the store twice: the prompt blocks a prefill worker put are skipped without asking the store, those a
sequence prefilled on the decode worker found there are skipped after asking it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
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
from waiting import wait_until_async

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
            await _written(decoder)
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
            await _written(decoder)
            out = await _local_decode(decoder, prompt, "resumed")
            await _written(decoder)
            chain = decode.kv_format.reusable_hashes(prompt + out)
            return await decode.kv.presence(chain), decoder.write_queue.lookups, await decode.kv.stats()

    present, lookups, stats = asyncio.run(scenario())
    assert len(present) >= 6 and all(present)  # 4 prompt blocks, 2+ generated
    assert lookups >= 1  # the local prefill's blocks were looked up before any data moved
    assert stats.bytes_in == stats.used_bytes, "a block the store held was sent again"


async def _written(decoder: DecodeServicer) -> None:
    """Until the write-back queue has nothing waiting and no write in flight."""
    async def idle() -> bool:
        return decoder.write_queue.idle
    assert await wait_until_async(idle, 30), "the write-back queue still had blocks waiting after 30 s"


def _paused_decode_scenario(batch_blocks: int, max_wait_s: float,
                            paused: Callable[..., Awaitable[object]]) -> tuple[object, bool]:
    """One sequence (2 prompt blocks and a partial one) decoded until its first generated block is
    full; then `paused(decode worker, decoder, that block's hash)` runs while the stream is not read
    (the engine goes on; the servicer sees nothing), then the stream is read to its end. Returns
    what `paused` returned and whether every block of the sequence was in the store afterwards."""
    torch.set_num_threads(1)
    checkpoint = load_checkpoint(STORIES_GGUF)
    prompt = (checkpoint.tokenizer.encode("Once upon a time, there was a little girl named Lily") * 4)[:2 * BS + 3]
    sampling = common_pb2.SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)

    async def scenario() -> tuple[object, bool]:
        async with _kvstore_and_workers(checkpoint) as (prefill, decode):
            decoder = DecodeServicer(decode, write_back=True)
            decoder.write_queue.batch_blocks, decoder.write_queue.max_wait_s = batch_blocks, max_wait_s
            done = await PrefillServicer(prefill).Prefill(worker_pb2.PrefillRequest(
                request_id="r", token_ids=prompt, sampling=sampling), None)
            tokens = [done.first_token]
            stream = decoder.Decode(worker_pb2.DecodeRequest(
                request_id="r", prompt_token_ids=prompt, first_token=done.first_token,
                block_hashes=done.block_hashes, sampling=sampling), None)
            while len(prompt) + len(tokens) <= 3 * BS + 1:  # until block 2 (the first generated) is full
                tokens.extend((await anext(stream)).token_ids)
            first_generated = decode.kv_format.reusable_hashes(prompt + tokens)[2]
            seen = await paused(decode, decoder, first_generated)
            tokens.extend([t async for chunk in stream for t in chunk.token_ids])
            await _written(decoder)  # the end sent what waited
            return seen, all(await decode.kv.presence(decode.kv_format.reusable_hashes(prompt + tokens)))
    return asyncio.run(scenario())


def test_a_filled_block_waits_for_others_and_a_finished_sequence_writes_at_once():
    """No batch, no timer: the full block waits while the sequence runs (a write per filled block
    is what the queue saves), and its last chunk sends every block without waiting."""
    async def paused(decode: Worker, decoder: DecodeServicer, block: bytes) -> tuple[bool, int]:
        await asyncio.sleep(0)  # a write started at once would be under way now
        return (await decode.kv.presence([block]))[0], decoder.write_queue.writes

    (present_while_running, writes), all_present = _paused_decode_scenario(10_000, 3600.0, paused)
    assert not present_while_running and writes == 0, "a filled block was written before a batch or the end"
    assert all_present, "the finished sequence's blocks did not go out at its end"


def test_a_filled_block_is_written_within_the_longest_wait_while_its_sequence_runs():
    """What a crash can lose is bounded: with no batch and no end in sight, the timer sends it."""
    async def paused(decode: Worker, decoder: DecodeServicer, block: bytes) -> bool:
        async def written() -> bool:
            return (await decode.kv.presence([block]))[0]
        return await wait_until_async(written, 20.0)

    present_while_running, all_present = _paused_decode_scenario(10_000, 0.2, paused)
    assert present_while_running is True, "the waiting block was not written within 20 s while its sequence ran"
    assert all_present
