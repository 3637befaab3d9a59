"""The measurements of `pdserve quant-eval`, each through an engine's own model (the serving forward).

Accuracy without a downloaded data set, as llama.cpp's `perplexity --kl-divergence` does it: the
reference is the FP32 model of the same file, and the held-out text is what that model writes
(sampled at temperature 1, request j seeded seed + j) to held-out chat prompts
(`data/smollm2_heldout_prompts.jsonl`, disjoint from the calibration prompts). At every position of
those answers, teacher-forced, a format's next-token distribution is compared with FP32's:

    KL      mean over positions of KL(fp32 || format), in nats
    top-1   the fraction of positions whose argmax agrees with FP32's
    ppl     exp(mean NLL) of the held-out answers under the format (FP32's own is its entropy rate)

The teacher-forced pass runs several sequences in one `LlamaModel.forward` (one prefill span each,
over a private paged cache in the engine's KV format, so every position attends to the stored and
possibly quantized keys and values), and the output head only on the scored rows. A task check asks
questions with known answers (`data/smollm2_tasks.jsonl`: arithmetic, capital cities) greedily
through the chat template and counts an answer right when a known answer is a word of its first line.

Speed: decode tokens/s at 1 and 32 streams (steps after every stream has its first token) and the
time to first token of a 200-token prompt, both on the engine (`Engine.step`), random prompts so
that no prefix is cached. Memory: the bytes of the weights as the model holds them, and the RSS of a
fresh process that serves the format (`python -m pdserve.quant.accuracy rss FLAGS`: `build_engine`
as a worker runs it, the checkpoint dropped as the worker drops it, then one request).
"""

from __future__ import annotations

import gc
import json
import random
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve.quant.calibration import DATA_DIR, chat_answers, chat_prompt_ids

HELDOUT_PROMPTS = DATA_DIR / "smollm2_heldout_prompts.jsonl"
TASKS = DATA_DIR / "smollm2_tasks.jsonl"
HELDOUT_SEED = 5000  # request j of the held-out answers samples with seed 5000 + j


# ---- held-out text -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Scored:
    """One held-out sequence: chat prompt + FP32's answer; tokens from `start` on are scored."""

    ids: list[int]
    start: int

    @property
    def positions(self) -> int:
        return len(self.ids) - self.start


MIN_POSITIONS_PER_PROMPT = 16  # a small --positions asks only the first prompts


def heldout_sequences(engine, tokenizer, prompts: list[str], positions: int, max_tokens: int = 96,
                      seed: int = HELDOUT_SEED) -> list[Scored]:
    """FP32's sampled answers to `prompts` (the first positions / 16 of them if fewer), cut to
    `positions` scored tokens in all, as evenly over the answers as their lengths allow (the prompts
    are asked again, with the next seeds, until the answers have that many)."""
    prompts = prompts[:max(1, min(len(prompts), positions // MIN_POSITIONS_PER_PROMPT))]
    seqs: list[Scored] = []
    while sum(s.positions for s in seqs) < positions:
        got = [Scored(p + a, len(p)) for p, a in chat_answers(engine, tokenizer, prompts, seed, max_tokens) if a]
        if not got:
            raise ValueError("the reference model answered every held-out prompt with nothing")
        seqs += got
        seed += len(prompts)
    return trim(seqs, positions)


def trim(seqs: list[Scored], positions: int) -> list[Scored]:
    """The sequences with their answers cut to `positions` scored tokens in all: each to at most
    the same length c (the smallest that is enough), the last ones one token shorter to make it exact."""
    c = next(c for c in range(1, max(s.positions for s in seqs) + 1)
             if sum(min(s.positions, c) for s in seqs) >= positions)
    excess = sum(min(s.positions, c) for s in seqs) - positions
    out = []
    for s in reversed(seqs):
        keep = min(s.positions, c)
        if excess and keep == c:
            keep, excess = keep - 1, excess - 1
        if keep:
            out.append(Scored(s.ids[:s.start + keep], s.start))
    return out[::-1]


def batches(seqs: list[Scored], max_tokens: int) -> list[list[Scored]]:
    """Consecutive sequences grouped into forwards of at most `max_tokens` tokens (one if longer)."""
    out: list[list[Scored]] = [[]]
    for s in seqs:
        if out[-1] and sum(len(x.ids) for x in out[-1]) + len(s.ids) > max_tokens:
            out.append([])
        out[-1].append(s)
    return [b for b in out if b]


# ---- teacher forcing -----------------------------------------------------------------------------

def teacher_forced_logits(model, seqs: list[Scored], kv_dtype: str, block_size: int = 16,
                          device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [n, V] fp32 predicting every scored token, those tokens [n]): one forward over all
    `seqs`, each a prefill span over its own blocks of a private cache in the KV format `kv_dtype`."""
    from pdserve.runtime.attention import AttentionMetadata, PrefillSpan
    from pdserve.runtime.config import CacheConfig
    from pdserve.runtime.kv_cache import allocate_kv_cache

    ids, positions, slots, spans, rows, targets = [], [], [], [], [], []
    offset = block = 0
    for s in seqs:
        t, nb = len(s.ids), -(-len(s.ids) // block_size)
        table = torch.arange(block, block + nb)
        pos = torch.arange(t)
        ids += s.ids
        positions.append(pos)
        slots.append(table[pos // block_size] * block_size + pos % block_size)
        spans.append(PrefillSpan(offset, t, t, table.to(device)))
        rows.append(torch.arange(offset + s.start - 1, offset + t - 1))  # row i predicts token i + 1
        targets += s.ids[s.start:]
        offset, block = offset + t, block + nb
    kv = allocate_kv_cache(model.config, CacheConfig(block_size=block_size, num_blocks=block, dtype=kv_dtype), device)
    meta = AttentionMetadata(slot_mapping=torch.cat(slots).to(device), num_decode_tokens=0,
                             decode_block_tables=torch.zeros(0, 0, dtype=torch.long, device=device),
                             decode_context_lens=torch.zeros(0, dtype=torch.long, device=device),
                             prefills=tuple(spans))
    hidden = model.forward(torch.tensor(ids, device=device), torch.cat(positions).to(device), meta, kv)  # [N, D]
    with torch.inference_mode():
        return model.compute_logits(hidden[torch.cat(rows).to(device)]).cpu(), torch.tensor(targets)


@dataclass(frozen=True)
class Agreement:
    kl: float  # mean KL(reference || format) per position, nats
    top1: float  # fraction of positions whose argmax agrees
    ppl: float  # perplexity of the scored tokens under the format
    positions: int


class AgreementSum:
    """Sums of KL, argmax agreements and NLL over batches of positions."""

    def __init__(self) -> None:
        self.kl = self.nll = 0.0
        self.agree = self.n = 0

    def add(self, ref: torch.Tensor, got: torch.Tensor, targets: torch.Tensor) -> None:
        """ref, got: logits [n, V]; targets: [n] the tokens that follow."""
        lr, lg = torch.log_softmax(ref.double(), -1), torch.log_softmax(got.double(), -1)
        self.kl += (lr.exp() * (lr - lg)).sum().item()
        self.agree += (ref.argmax(-1) == got.argmax(-1)).sum().item()
        self.nll -= lg.gather(-1, targets[:, None]).sum().item()
        self.n += len(targets)

    def result(self) -> Agreement:
        import math

        return Agreement(self.kl / self.n, self.agree / self.n, math.exp(self.nll / self.n), self.n)


class Reference:
    """The reference's logits at every scored position, batch by batch, kept for every comparison."""

    def __init__(self, engine, seqs: list[Scored], max_batch_tokens: int = 1024) -> None:
        self.batches = batches(seqs, max_batch_tokens)
        self.logits = [engine_logits(engine, b) for b in self.batches]

    def compare(self, engine) -> Agreement:
        acc = AgreementSum()
        for b, (ref, targets) in zip(self.batches, self.logits):
            got, _ = engine_logits(engine, b)
            acc.add(ref, got, targets)
        return acc.result()


def engine_logits(engine, seqs: list[Scored]) -> tuple[torch.Tensor, torch.Tensor]:
    """teacher_forced_logits through `engine`'s model, in its KV format and block size."""
    cache = engine.config.cache
    return teacher_forced_logits(engine.runner.model, seqs, cache.dtype, cache.block_size, engine.config.device)


# ---- the task check ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Task:
    question: str
    answers: tuple[str, ...]  # any of them in the first line counts


def load_tasks(path: Path = TASKS) -> list[Task]:
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [Task(r["question"], tuple(r["answers"])) for r in rows]


def first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "")


def is_correct(answer: str, known: tuple[str, ...]) -> bool:
    """A known answer appears in the first line as a word of its own ("42" is not in "142")."""
    line = first_line(answer).lower()
    return any(re.search(rf"(?<!\w){re.escape(k.lower())}(?!\w)", line) for k in known)


@dataclass(frozen=True)
class TaskResult:
    score: float  # fraction answered right
    answers: tuple[str, ...]  # the model's answers, in task order


def task_score(engine, tokenizer, tasks: list[Task], max_tokens: int = 32) -> TaskResult:
    """Every task asked greedily through the chat template, in one batch."""
    from pdserve.runtime.sampling_params import SamplingParams

    prompts = [chat_prompt_ids(tokenizer, t.question) for t in tasks]
    seqs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0))
    answers = tuple(tokenizer.decode(s.output_ids) for s in seqs)
    return TaskResult(sum(is_correct(a, t.answers) for a, t in zip(answers, tasks)) / len(tasks), answers)


# ---- speed ---------------------------------------------------------------------------------------

_request_ids = iter(range(1 << 62))


def random_prompts(vocab_size: int, count: int, length: int, seed: int) -> list[list[int]]:
    """Token ids away from the special ones at the bottom of the vocabulary; distinct per seed, so
    that no prefix is cached from an earlier measurement."""
    rng = random.Random(seed)
    low = min(100, vocab_size // 4)
    return [[rng.randrange(low, vocab_size) for _ in range(length)] for _ in range(count)]


def decode_tokens_per_s(engine, streams: int, tokens: int, seed: int, prompt_len: int = 16) -> float:
    """Tokens/s of the decode steps of `streams` sequences run together (after the step that gives
    every one its first token, so prefill is not counted)."""
    from pdserve.runtime.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    seqs = [engine.add_request(f"speed-{next(_request_ids)}", p, params)
            for p in random_prompts(engine.model_config.vocab_size, streams, prompt_len, seed)]
    while any(not s.output_ids for s in seqs):
        engine.step()
    done, start = sum(len(s.output_ids) for s in seqs), time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return (sum(len(s.output_ids) for s in seqs) - done) / (time.perf_counter() - start)


def ttft_s(engine, prompt_len: int, seed: int) -> float:
    """Seconds from adding one `prompt_len`-token request to the step that returns its first token."""
    from pdserve.runtime.sampling_params import SamplingParams

    (prompt,) = random_prompts(engine.model_config.vocab_size, 1, prompt_len, seed)
    start = time.perf_counter()
    seq = engine.add_request(f"ttft-{next(_request_ids)}", prompt, SamplingParams(max_tokens=1, temperature=0))
    while not seq.output_ids:
        engine.step()
    elapsed = time.perf_counter() - start
    while engine.has_unfinished():
        engine.step()
    return elapsed


@dataclass(frozen=True)
class Speed:
    tokens_per_s_1: float
    tokens_per_s_32: float
    ttft_200_s: float


def measure_speed(engine, rounds: int = 2, tokens: int = 32, seed: int = 0) -> Speed:
    """Best of `rounds` of each measurement (a shared CPU's load only ever slows a round down)."""
    decode_tokens_per_s(engine, 2, 4, seed=seed)  # warm-up: first-call allocations and dispatch
    one = max(decode_tokens_per_s(engine, 1, tokens, seed + 10 + r) for r in range(rounds))
    many = max(decode_tokens_per_s(engine, 32, tokens, seed + 20 + r) for r in range(rounds))
    ttft = min(ttft_s(engine, 200, seed + 30 + r) for r in range(rounds))
    return Speed(one, many, ttft)


# ---- the wire -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class KVTransfer:
    wire_bytes_per_token: float  # encoded blocks (header, scale rows included) / tokens
    seconds: float  # one prompt's blocks encoded, put into a KV store, got back and decoded


def kv_transfer(engine, prompt_len: int = 200, rounds: int = 3) -> KVTransfer:
    """What moving one `prompt_len`-token prompt's KV costs on the prefill -> store -> decode path:
    its blocks (of the engine's cache, in its KV format) through `kvwire` and a real KV store on
    loopback (gRPC), best of `rounds`."""
    import asyncio
    import hashlib

    from kvstore.client import KVStoreClient
    from kvstore.server import serve
    from pdserve.kvwire import decode_block, encode_block

    fmt = engine.kv_format
    n = -(-prompt_len // fmt.block_size)
    blocks = [engine.kv_cache[i] for i in range(n)]

    async def one_round(client: KVStoreClient, r: int) -> tuple[float, int]:
        hashes = [hashlib.blake2b(f"{r}/{i}".encode(), digest_size=16).digest() for i in range(n)]
        start = time.perf_counter()
        wire = [encode_block(b, fmt, fmt.block_size) for b in blocks]
        await client.put_blocks(f"kv-transfer-{r}", zip(hashes, wire))
        for data in await client.get_blocks(hashes):
            decode_block(data, fmt)
        elapsed = time.perf_counter() - start
        await client.release(f"kv-transfer-{r}", drop=True)
        return elapsed, sum(map(len, wire))

    async def run() -> KVTransfer:
        server, port = await serve("127.0.0.1:0", capacity_bytes=1 << 30)
        try:
            async with KVStoreClient(f"127.0.0.1:{port}") as client:
                got = [await one_round(client, r) for r in range(rounds)]
        finally:
            await server.stop(None)
        return KVTransfer(got[0][1] / (n * fmt.block_size), min(t for t, _ in got))

    return asyncio.run(run())


# ---- memory --------------------------------------------------------------------------------------

def _tensor_bytes(t) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else t.nbytes


def weight_bytes(model) -> int:
    """Bytes of every weight as the model holds it (a tied head counted once)."""
    total = _tensor_bytes(model.embed) + _tensor_bytes(model.final_norm)
    if model.lm_head is not model.embed:
        total += _tensor_bytes(model.lm_head)
    for layer in model.layers:
        total += _tensor_bytes(layer.input_norm) + _tensor_bytes(layer.post_norm)
        total += sum(lin.nbytes for lin in _projections(model, layer))
    return total


def projection_bits(model) -> float:
    """Resident bits per weight of the decoder projections (scales, zeros, packings included)."""
    config = model.config
    shapes = config.arch.expected_shapes(config)
    params = sum(shapes[n][0] * shapes[n][1] for n in config.arch.projection_names(config))
    return 8 * sum(lin.nbytes for layer in model.layers for lin in _projections(model, layer)) / params


def _projections(model, layer) -> list:
    """The layer's linears, one per site of the architecture (qkv, o, gate_up, down)."""
    return [getattr(layer, site.name) for site in model.config.arch.sites]


def serving_rss(flags: list[str], timeout_s: float = 600.0) -> dict[str, int]:
    """{"rss": VmRSS of a fresh process serving `flags` (engine flags: --model, --dtype, ...) after
    one request, "rss_before_load": the same process after its imports}, bytes."""
    cmd = [sys.executable, "-m", "pdserve.quant.accuracy", "rss", *flags]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    if out.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed: {out.stderr.strip()[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def vm_rss() -> int:
    """Resident bytes of this process now (Linux /proc; peak RSS elsewhere)."""
    status = Path("/proc/self/status")
    if status.exists():
        for line in status.read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _rss_main(argv: list[str]) -> int:
    import argparse
    import importlib

    from pdserve.engine_args import add_engine_args, build_engine
    from pdserve.runtime.sampling_params import SamplingParams

    importlib.import_module("pdserve.runtime.engine")  # its imports belong to "before the load"

    p = argparse.ArgumentParser(prog="python -m pdserve.quant.accuracy rss")
    add_engine_args(p)
    args = p.parse_args(argv)
    before = vm_rss()
    engine, _ = build_engine(args)  # as a worker does (pdserve.worker_common): the checkpoint is dropped
    gc.collect()
    engine.generate(random_prompts(engine.model_config.vocab_size, 1, 16, 0),
                    SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    print(json.dumps({"rss": vm_rss(), "rss_before_load": before, "weight_format": engine.weight_format}))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] != ["rss"]:
        sys.exit("usage: python -m pdserve.quant.accuracy rss ENGINE-FLAGS")
    sys.exit(_rss_main(sys.argv[2:]))
