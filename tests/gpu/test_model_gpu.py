"""The whole model on a GPU (CuPy kernels, CUDA-graph decode) against the CPU engine.

Greedy tokens must be identical to the CPU run for the same weights in fp32 (the kernels
accumulate in fp32, so argmax ties are the only way to differ, and these prompts have none),
and decode steps replayed from CUDA graphs must give the eager step's logits.
"""

from __future__ import annotations

import pytest
import torch

from conftest import STORIES_GGUF, model_config_from_hf, random_hf_model, require_gpu

require_gpu()

from pdserve.runtime.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from pdserve.runtime.engine import Engine  # noqa: E402
from pdserve.runtime.kernels import cuda_ops  # noqa: E402
from pdserve.runtime.loader import load_checkpoint  # noqa: E402
from pdserve.runtime.sampling_params import SamplingParams  # noqa: E402

GREEDY = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
STORY_PROMPTS = ["Once upon a time", "The little dog", "Lily and Tom went to the park and"]


def _engine(model_config, weights, device: str, graphs: bool, max_num_seqs: int = 64) -> Engine:
    config = EngineConfig(cache=CacheConfig(block_size=16, num_blocks=1024),
                          scheduler=SchedulerConfig(max_num_seqs=max_num_seqs), device=device,
                          cuda_graph=graphs)
    engine = Engine(model_config, weights, "f" * 32, config)
    assert (engine.runner.graphs is not None) == (graphs and device == "cuda")
    return engine


def _greedy(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    return [list(s.output_ids) for s in engine.generate(prompts, GREEDY)]


@pytest.fixture(scope="module")
def stories():
    return load_checkpoint(STORIES_GGUF)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "cuda-graph"])
def test_stories260k_greedy_equals_cpu(stories, graphs: bool) -> None:
    prompts = [stories.tokenizer.encode(p) for p in STORY_PROMPTS]
    cpu = _greedy(_engine(stories.config, stories.weights, "cpu", False), prompts)
    gpu_engine = _engine(stories.config, stories.weights, "cuda", graphs)
    assert gpu_engine.runner.model.kernels is cuda_ops
    assert _greedy(gpu_engine, prompts) == cpu
    gpu_engine.check_leaks()


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "cuda-graph"])
def test_random_llama_head_dim_128_greedy_equals_cpu(graphs: bool) -> None:
    hf = random_hf_model(vocab_size=1000, hidden_size=512, intermediate_size=1024, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=1024)
    config = model_config_from_hf(hf.config, "llama")
    assert config.head_dim == 128
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 1000, (n,), generator=gen).tolist() for n in (5, 40, 130, 300)]
    cpu = _greedy(_engine(config, hf.state_dict(), "cpu", False), prompts)
    assert _greedy(_engine(config, hf.state_dict(), "cuda", graphs), prompts) == cpu


@pytest.mark.parametrize("batch", [3, 33], ids=["padded-to-4", "padded-to-48"])
def test_graph_replay_logits_equal_eager(stories, batch: int) -> None:
    """Every decode step of a batch that needs padding: graph logits == eager logits."""
    gen = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(3, 500, (int(n),), generator=gen).tolist()
               for n in torch.randint(1, 60, (batch,), generator=gen)]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    runs = []
    for graphs in (False, True):
        engine = _engine(stories.config, stories.weights, "cuda", graphs)
        engine.keep_logits = True
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, params)
        steps = []
        while engine.has_unfinished():
            engine.step()
            steps.append(engine.last_logits.clone())
        runs.append(steps)
    eager, replayed = runs
    assert len(eager) == len(replayed)
    for e, r in zip(eager, replayed):
        torch.testing.assert_close(r, e, atol=1e-5, rtol=1e-5)
