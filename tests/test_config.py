"""The services' configs (issue 17, item 4): GatewayConfig, KVStoreConfig and WorkerConfig are frozen,
validated dataclasses built once in each main from flags and environment.

Each refuses a bad value with a ValueError naming the flag (or the variable, for environment-only
settings); the flags derived from their fields appear in --help with their defaults; a flag and its
environment variable build the same config (the flag winning when both are set); and the kvstore's
watermarks have one default, in process and from either command line.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
from types import SimpleNamespace

import pytest

from gateway.config import GatewayConfig
from gateway.deadlines import Deadlines
from gateway.disagg import DisaggConfig
from gateway.request_limits import RequestLimits
from gateway.slo import SloConfig
from kvstore.config import KVStoreConfig
from pdserve.cli import build_parser
from pdserve.commands import decode as decode_command
from pdserve.commands import gateway as gateway_command
from pdserve.commands import kvstore as kvstore_command
from pdserve.commands import prefill as prefill_command
from pdserve.config_flags import Setting, settings
from pdserve.grpc_server import ProcessConfig
from pdserve.worker_config import WorkerConfig

COMMANDS = {GatewayConfig: gateway_command, KVStoreConfig: kvstore_command, WorkerConfig: decode_command}


def parser_of(command) -> argparse.ArgumentParser:
    """A command's parser as `pdserve` builds it, wide enough that no help line wraps."""
    p = argparse.ArgumentParser(prog=command.NAME, formatter_class=lambda prog: argparse.HelpFormatter(
        prog, width=1000, max_help_position=1000))
    command.add_arguments(p)
    return p


def build(cls: type, argv: list[str], env: dict[str, str]):
    return cls.from_args(parser_of(COMMANDS[cls]).parse_args(argv), env)


def flagged(cls: type) -> list[Setting]:
    """The settings of `cls` that have a flag of their own (not declared by another module)."""
    return [s for s in settings(cls) if s.flag and not s.meta["external"]]


# ---- validation ---------------------------------------------------------------------------------

BAD_VALUES = [
    (lambda: GatewayConfig(http_port=70000), "--http-port"),
    (lambda: GatewayConfig(max_inflight=0), "--max-inflight"),
    (lambda: GatewayConfig(block_size=12), "--block-size"),
    (lambda: GatewayConfig(admission_ttft_slo_ms=-1), "--admission-ttft-slo-ms"),
    (lambda: GatewayConfig(disagg_policy="sometimes"), "--disagg-policy"),
    (lambda: GatewayConfig(hot_prefix_min=-1), "--hot-prefix-min"),
    (lambda: GatewayConfig(probe_failures=0), "--probe-failures"),
    (lambda: GatewayConfig(breaker_cooldown_s=60), "--breaker-cooldown-s"),
    (lambda: GatewayConfig(retry_ratio=2), "--retry-ratio"),
    (lambda: GatewayConfig(log_level="LOUD"), "--log-level"),
    (lambda: RequestLimits(max_tokens=0), "--max-tokens-limit"),
    (lambda: Deadlines(decode_stall_s=-1), "--decode-stall-timeout-s"),
    (lambda: DisaggConfig(busy_fraction=2), "--disagg-busy-fraction"),
    (lambda: SloConfig(threshold_s=0), "--slo-ttft-p99-ms"),
    (lambda: KVStoreConfig(capacity_bytes=0), "--capacity-mb"),
    (lambda: KVStoreConfig(low_watermark=0.99), "--low-watermark"),
    (lambda: KVStoreConfig(backend="memcached://kv"), "--kv-backend"),
    (lambda: KVStoreConfig(backend_timeout_s=0), "--backend-timeout-ms"),
    (lambda: WorkerConfig(residency_interval_s=0), "--residency-interval-s"),
    (lambda: WorkerConfig(kv_shared_memory_mb=-1), "--kv-shared-memory-mb"),
    (lambda: WorkerConfig(stream_interval=0), "--stream-interval"),
    (lambda: WorkerConfig(batch_window_s=-1), "--batch-window-ms"),
    (lambda: WorkerConfig(decode_yield_s=float("nan")), "--decode-yield-ms"),
    (lambda: WorkerConfig(engine_fault_after_steps=-1), "PDSERVE_TEST_ENGINE_FAULT_AFTER_STEPS"),
    (lambda: WorkerConfig(kv_mac_key=b"short"), "PDSERVE_KV_MAC_KEY"),
    (lambda: ProcessConfig(traces="jaeger"), "PDSERVE_TRACES"),
    (lambda: ProcessConfig(metrics_port=70000), "--metrics-port"),
]


@pytest.mark.parametrize(("make", "flag"), BAD_VALUES, ids=[flag for _, flag in BAD_VALUES])
def test_a_bad_value_is_refused_naming_its_flag(make, flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        make()


def test_configs_are_frozen_and_every_setting_is_documented() -> None:
    for cls in (GatewayConfig, KVStoreConfig, WorkerConfig):
        with pytest.raises(dataclasses.FrozenInstanceError):
            cls().log_level = "DEBUG"
        for s in settings(cls):
            assert s.meta["doc"], f"{cls.__name__}.{s.name} has no text"


def test_bad_flags_and_variables_are_refused_at_start(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(ValueError, match="--http-port must be in 0..65535"):
        build(GatewayConfig, ["--http-port", "70000"], {})
    with pytest.raises(ValueError, match="PDSERVE_HOT_PREFIX_MIN must be a whole number, got 'many'"):
        build(GatewayConfig, [], {"PDSERVE_HOT_PREFIX_MIN": "many"})
    with pytest.raises(ValueError, match="PDSERVE_SESSION_PREFETCH must be one of"):
        build(GatewayConfig, [], {"PDSERVE_SESSION_PREFETCH": "maybe"})
    with pytest.raises(ValueError, match="PDSERVE_DTYPE must be one of"):
        build(GatewayConfig, [], {"PDSERVE_DTYPE": "float8"})
    with pytest.raises(ValueError, match="PDSERVE_TRACES must be none, otlp"):
        build(KVStoreConfig, [], {"PDSERVE_TRACES": "jaeger"})
    # Each command refuses with one line and exit 2 before it starts anything (or loads a model).
    for argv, message in [(["gateway", "--prefill", "a:1", "--decode", "b:1", "--max-inflight", "0"],
                           "--max-inflight must be >= 1"),
                          (["kvstore", "--low-watermark", "0.99"], "--low-watermark (0.99) <= --high-watermark"),
                          (["decode", "--residency-interval-s", "0"], "--residency-interval-s")]:
        args = build_parser().parse_args(argv)
        assert args._run(args) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("pdserve ") and message in err and "\n" not in err


# ---- flags derived from the fields --------------------------------------------------------------


@pytest.mark.parametrize("cls", [GatewayConfig, KVStoreConfig, WorkerConfig])
def test_every_flag_is_in_help_with_its_default(cls: type) -> None:
    text = parser_of(COMMANDS[cls]).format_help()
    for s in flagged(cls):
        default = s.meta["shown"] if s.meta["shown"] is not None else str(s.to_flag(s.default))
        expected = f"(default: ${s.env}, else {default})" if s.env else f"(default: {default})"
        line = next((ln for ln in text.splitlines() if ln.lstrip().startswith(s.flag)), None)
        assert line is not None, f"{s.flag} is not in `{COMMANDS[cls].NAME} --help`"
        assert line.endswith(expected), (s.flag, line)


def test_flags_keep_their_names_and_parse_to_the_fields() -> None:
    """The flag names tests, docs, `pdserve up`, compose and deploy/k8s pass still work."""
    config = build(GatewayConfig, [
        "--bind", "0.0.0.0:50051", "--http-port", "8001", "--prefill", "dns:///prefill:50061",
        "--decode", "dns:///decode:50062", "--kvstore", "kvstore:50070", "--max-inflight", "7",
        "--max-tokens-limit", "9", "--decode-stall-timeout-s", "5", "--http-timeout-s", "6",
        "--disagg-policy", "conditional", "--disagg-prefill-ms-per-token", "2", "--admission-ttft-slo-ms", "300",
        "--deployment-targets", "a:prefill=x:1", "--deployment-targets", "a:decode=y:1", "--config", "f.toml"], {})
    assert (config.bind, config.http_port, config.prefill, config.decode, config.kvstore, config.max_inflight) == (
        "0.0.0.0:50051", 8001, "dns:///prefill:50061", "dns:///decode:50062", "kvstore:50070", 7)
    assert config.limits.max_tokens == 9 and config.deadlines == Deadlines(5, 6)
    assert config.disagg_policy == "conditional" and config.disagg.prefill_s_per_token == pytest.approx(0.002)
    assert config.admission_ttft_slo_ms == 300 and config.serve_config == "f.toml"
    assert config.deployment_targets == ("a:prefill=x:1", "a:decode=y:1")
    kv = build(KVStoreConfig, ["--bind", "0.0.0.0:50070", "--capacity-mb", "2048", "--backend-timeout-ms", "250"], {})
    assert (kv.bind, kv.capacity_bytes, kv.backend_timeout_s) == ("0.0.0.0:50070", 2048 << 20, 0.25)
    worker = build(WorkerConfig, ["--bind", "0.0.0.0:50062", "--kvstore", "kvstore:50070", "--max-batch-size", "32",
                                  "--batch-window-ms", "5", "--worker-id", "d0", "--no-kv-write-back",
                                  "--decode-yield-ms", "250"], {})
    assert (worker.bind, worker.kvstore, worker.worker_id, worker.kv_write_back) == (
        "0.0.0.0:50062", "kvstore:50070", "d0", False)
    assert worker.batch_window_s == pytest.approx(0.005) and worker.decode_yield_s == pytest.approx(0.25)


def test_a_prefill_worker_has_no_decode_only_flags() -> None:
    text = parser_of(prefill_command).format_help()
    assert "--kv-write-back" not in text and "--residency-interval-s" not in text and "--log-level" in text
    assert "--decode-yield-ms" not in text


# ---- environment and flags ----------------------------------------------------------------------

# A valid value other than the default, per variable (in the flag's units), for every setting with both.
OTHER_VALUES = {
    "PDSERVE_DTYPE": "bfloat16", "PDSERVE_ADMISSION_TTFT_SLO_MS": "300", "PDSERVE_API_KEYS_FILE": "/run/keys",
    "PDSERVE_SESSION_PREFETCH": "0", "PDSERVE_HOT_PREFIX_MIN": "0", "PDSERVE_SLO_TTFT_P99_MS": "400",
    "PDSERVE_SLO_WINDOW_S": "30", "PDSERVE_SLO_MIN_SAMPLES": "5", "PDSERVE_PROBE_FAILURES": "3",
    "PDSERVE_BREAKER_FAILURES": "7", "PDSERVE_BREAKER_COOLDOWN_S": "2", "PDSERVE_BREAKER_MAX_COOLDOWN_S": "20",
    "PDSERVE_RETRY_RATIO": "0.5", "PDSERVE_RETRY_MIN": "1", "PDSERVE_RETRY_WINDOW_S": "5",
    "PDSERVE_LOG_LEVEL": "DEBUG", "PDSERVE_LOG_PROMPTS": "1", "PDSERVE_TRACES": "console",
    "PDSERVE_METRICS_PORT": "9100", "PDSERVE_METRICS_HOST": "0.0.0.0", "PDSERVE_KV_BACKEND": "redis://redis:6379/0",
    "PDSERVE_SERVICE_THREADS": "normal",
    "PDSERVE_KV_WRITE_BACK": "0", "PDSERVE_KV_SHARED_MEMORY_MB": "16", "PDSERVE_STEP_LOG_DIR": "/tmp/steps", "PDSERVE_RESIDENCY_INTERVAL_S": "0.2", "PDSERVE_DRAIN_TIMEOUT_S": "5",
    "PDSERVE_API_KEY": "sk-test-key", "PDSERVE_ALLOWED_ORIGINS": "http://localhost:3000",
}


def _flag_argv(s: Setting, raw: str) -> list[str]:
    if s.value_type is bool:
        return [s.flag if raw == "1" else "--no-" + s.flag[2:]]
    return [s.flag, raw]


@pytest.mark.parametrize("cls", [GatewayConfig, KVStoreConfig, WorkerConfig])
def test_a_variable_and_its_flag_build_the_same_config(cls: type) -> None:
    both = [s for s in flagged(cls) if s.env]
    assert {s.env for s in both} <= set(OTHER_VALUES), "a new variable: give it a value above"
    base = build(cls, [], {})  # the defaults (a worker's bind is its command's)
    for s in both:
        raw = OTHER_VALUES[s.env]
        from_env, from_flag = build(cls, [], {s.env: raw}), build(cls, _flag_argv(s, raw), {})
        assert from_env == from_flag != base, s.name
        if s.default is None or s.default == ():
            continue  # no flag value says "none" (nor "no items", for a repeatable one)
        # The flag wins over the variable, even when it says the default.
        default_argv = _flag_argv(s, "1" if s.default is True else "0") if s.value_type is bool else \
            [s.flag, str(s.to_flag(s.default))]
        assert build(cls, default_argv, {s.env: raw}) == base, s.name


def test_environment_only_settings() -> None:
    env = {"PDSERVE_TLS_CA": __file__, "PDSERVE_INTERNAL_TOKEN": "t" * 20, "PDSERVE_KV_MAC_KEY": "k" * 32,
           "PDSERVE_TEST_ENGINE_FAULT_AFTER_STEPS": "3"}
    worker = build(WorkerConfig, [], env)
    assert worker.process.tls.ca == __file__ and worker.process.internal_token == "t" * 20
    assert worker.kv_mac_key == b"k" * 32 and worker.engine_fault_after_steps == 3
    assert "t" * 20 not in repr(worker) and "k" * 32 not in repr(worker)  # secrets stay out of logs
    help_text = parser_of(decode_command).format_help()
    assert "INTERNAL_TOKEN" not in help_text and "MAC_KEY" not in help_text  # never a flag
    assert build(GatewayConfig, [], env).process == worker.process == ProcessConfig.from_env(env)


# ---- one default per setting --------------------------------------------------------------------


def test_kvstore_watermarks_have_one_default_in_process_and_from_the_cli() -> None:
    from kvstore.server import build_store, parse_args, serve

    in_process = KVStoreConfig()
    assert (in_process.high_watermark, in_process.low_watermark) == (0.95, 0.85)
    assert build(KVStoreConfig, [], {}) == in_process  # `pdserve kvstore`
    assert KVStoreConfig.from_args(parse_args([]), {}) == in_process  # `python -m kvstore.server`
    memory = build_store(in_process).memory  # what serve/serve_store build from it
    assert (memory.high_bytes, memory.low_bytes) == (int(in_process.capacity_bytes * 0.95),
                                                      int(in_process.capacity_bytes * 0.85))
    assert not {"high_watermark", "low_watermark"} & set(inspect.signature(serve).parameters)  # no second default
    # `pdserve up` starts its kvstore with the same command line, so the same defaults.
    workers, _ = __import__("pdserve.commands.up", fromlist=["plan"]).plan(build_parser().parse_args(["up"]))
    kv = build_parser().parse_args(list(workers[0].command[3:]))
    assert KVStoreConfig.from_args(kv, {}).high_watermark == 0.95


def test_the_defaults_elsewhere_are_the_configs() -> None:
    from gateway.flow import RequestFlow

    flow_defaults = inspect.signature(RequestFlow).parameters
    gateway = GatewayConfig()
    assert flow_defaults["session_prefetch"].default == gateway.session_prefetch
    assert flow_defaults["hot_prefix_min"].default == gateway.hot_prefix_min
    assert build(GatewayConfig, [], {}) == gateway
    up = build_parser().parse_args(["up"])
    assert (up.max_inflight, up.http_port, up.kvstore_capacity_mb) == (
        gateway.max_inflight, gateway.http_port, KVStoreConfig().capacity_bytes / (1 << 20))


def test_the_config_reaches_the_flow_and_the_worker() -> None:
    from gateway.limits import InflightLimit
    from gateway.server import build_flow
    from pdserve.worker_common import Worker

    settings = build(GatewayConfig, ["--max-tokens-limit", "9", "--disagg-policy", "always-local"],
                     {"PDSERVE_SESSION_PREFETCH": "0", "PDSERVE_HOT_PREFIX_MIN": "0"})
    pool = SimpleNamespace(routable_count=lambda: 1)
    flow = build_flow(SimpleNamespace(), pool, pool, None, InflightLimit(1), settings)
    assert flow.limits.max_tokens == 9 and not flow.session_prefetch and flow.hot is None
    assert type(flow.placement.inner).__name__ == "AlwaysLocal"
    assert Worker("w", None, None, None, None).config == WorkerConfig()  # built without one: the defaults
