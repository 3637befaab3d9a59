"""The baseline: the same conversations through transformers `generate()`, in this process.

transformers has no server and no continuous batching, so the fair offline equivalent is static
batches (left padding; each batch runs until its longest request is done, like bench-engine). Turn k
of every conversation is generated after turn k-1 of all of them, its prompt built from the text
transformers produced (greedy on the same weights: the same text as the stack's). Arrival times and
think times do not apply: every request of a round is there at once, so its latencies are counted
from the start of its batch (service time, no queueing). A LogitsProcessor timestamps every
generation step: a request's TTFT is its batch's first step, its ITL the gaps between steps.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from pdserve.bench.client import RequestRecord, RunResult
from pdserve.bench.workloads import Conversation


class _StepClock:
    """A LogitsProcessor that only notes when each step's logits are ready."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores


def run_hf(checkpoint, conversations: Sequence[Conversation], batch_size: int = 32, label: str = "transformers",
           on_record: Callable[[RequestRecord], None] | None = None) -> RunResult:
    import torch
    from transformers import LogitsProcessorList

    from gateway.prompts import tokenize_prompt
    from pdserve.hf_baseline import hf_model

    model = hf_model(checkpoint.config, checkpoint.weights)
    tokenizer = checkpoint.tokenizer
    history = {c.id: "" for c in conversations}
    records: list[RequestRecord] = []
    t0 = time.perf_counter()
    for k in range(max((len(c.turns) for c in conversations), default=0)):
        round_ = [c for c in conversations if len(c.turns) > k]
        for b in range(0, len(round_), batch_size):
            batch = round_[b:b + batch_size]
            prompts = [history[c.id] + c.turns[k].text for c in batch]
            ids = [tokenize_prompt(tokenizer, p) for p in prompts]
            lens = [c.turns[k].max_tokens for c in batch]
            width = max(map(len, ids))
            input_ids = torch.tensor([[0] * (width - len(p)) + p for p in ids])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ids])
            clock = _StepClock()
            start = time.perf_counter()
            with torch.inference_mode():
                out = model.generate(input_ids=input_ids, attention_mask=mask, do_sample=False,
                                     max_new_tokens=max(lens), min_new_tokens=max(lens), pad_token_id=0,
                                     logits_processor=LogitsProcessorList([clock]))
            for i, c in enumerate(batch):
                n = lens[i]
                times = clock.times[:n]
                generated = out[i, width:width + n].tolist()
                text = tokenizer.decode(generated)
                record = RequestRecord(c.id, k, start - t0, prompt_tokens=len(ids[i]), output_tokens=n,
                                       ttft=times[0] - start, latency=times[-1] - start,
                                       itl=[b2 - a for a, b2 in zip(times, times[1:])], text=text)
                records.append(record)
                history[c.id] = prompts[i] + text
                if on_record is not None:
                    on_record(record)
    return RunResult(label, records, time.perf_counter() - t0)
