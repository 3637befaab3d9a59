"""Sampled rows drawn on the GPU (pdserve.runtime.token_draw with CUDA logits): the same
distribution as the CPU's draws of the same logits, seeded rows reproducible, filters kept."""

from __future__ import annotations

import torch

from conftest import require_gpu

require_gpu()

from pdserve.runtime.sampler import sample  # noqa: E402
from pdserve.runtime.sampling_params import SamplingParams  # noqa: E402
from pdserve.runtime.sequence import Sequence  # noqa: E402
from pdserve.runtime.token_draw import draw_tokens  # noqa: E402

DRAWS = 20_000


def test_gpu_draws_have_the_cpus_distribution():
    torch.manual_seed(0)
    logits = torch.randn(256) * 2
    params = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.02)
    shares = []
    for device in ("cpu", "cuda"):
        rows = logits.to(device).expand(DRAWS, -1)
        tokens = draw_tokens(rows, [params] * DRAWS, [None] * DRAWS)
        shares.append(torch.bincount(torch.tensor(tokens), minlength=256).double() / DRAWS)
    assert set(shares[1].nonzero().flatten().tolist()) <= set(logits.topk(40).indices.tolist())
    assert 0.5 * float((shares[0] - shares[1]).abs().sum()) < 0.04


def test_seeded_gpu_rows_reproduce_beside_greedy_and_penalised_rows():
    torch.manual_seed(1)
    logits = (torch.randn(4, 1000) * 3).cuda()
    seqs = [Sequence("a", [1, 2], SamplingParams(temperature=0.7, top_p=0.95, seed=5)),
            Sequence("b", [1, 2], SamplingParams(temperature=0)),
            Sequence("c", [1, 2], SamplingParams(temperature=1.0, presence_penalty=0.5, seed=6)),
            Sequence("d", [1, 2], SamplingParams(temperature=0, repetition_penalty=1.2, logprobs=2))]
    first, again = sample(logits, seqs), sample(logits, seqs)
    assert [t for t, _ in first] == [t for t, _ in again]
    assert first[1][0] == int(logits[1].argmax())
    assert first[3][1] is not None and len(first[3][1].top) == 2
