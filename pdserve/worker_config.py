"""WorkerConfig: every setting of a prefill or decode worker besides its engine's, built once.

`pdserve prefill` / `pdserve decode` build it in `worker_common.run_worker` from the flags and the
environment (`WorkerConfig.from_args`) and put it on the `Worker` (`worker.config`), which is
how the servicers and the parts they build get their settings. The engine's own settings stay in
`pdserve.runtime.config.EngineConfig` (built from the same flags by `pdserve.engine_args`).

Flags: `add_arguments` adds the ones derived from the fields below; bind, kvstore, worker id and
batch window are declared by `pdserve.engine_args.add_worker_args` with the engine's flags (they
predate this class, and `pdserve up`, compose and k8s pass them) and read from the parsed flags
like the rest. Environment variables keep their names (PDSERVE_KV_WRITE_BACK, ...).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from pdserve import kv_mac
from pdserve.config_flags import LOG_LEVEL_ENV, FromFlags, add_flags, check_log_level, nested, setting
from pdserve.grpc_server import ProcessConfig

WRITE_BACK_ENV = "PDSERVE_KV_WRITE_BACK"  # "0" turns the write-back of generated blocks off
RESIDENCY_INTERVAL_ENV = "PDSERVE_RESIDENCY_INTERVAL_S"
SHARED_MEMORY_ENV = "PDSERVE_KV_SHARED_MEMORY_MB"
DRAIN_TIMEOUT_ENV = "PDSERVE_DRAIN_TIMEOUT_S"
STEP_LOG_DIR_ENV = "PDSERVE_STEP_LOG_DIR"
# Tests only: the worker's engine fails its step after this many steps (a stand-in for an engine bug).
ENGINE_FAULT_ENV = "PDSERVE_TEST_ENGINE_FAULT_AFTER_STEPS"
# Settings a prefill worker has no use for.
DECODE_ONLY = ("kv_write_back", "residency_interval_s", "decode_yield_s", "stream_interval")


def check_decode_yield_ms(ms: float) -> None:
    """--decode-yield-ms must be >= 0 (NaN too is refused): a decode worker's check, and `pdserve up`'s
    before it starts any."""
    if not ms >= 0:
        raise ValueError(f"--decode-yield-ms must be >= 0 (0: never yield), got {ms:g}")


def check_stream_interval(tokens: int) -> None:
    """--stream-interval must be at least 1: a decode worker's check, and `pdserve up`'s before it
    starts any."""
    if tokens < 1:
        raise ValueError(f"--stream-interval must be at least 1 token, got {tokens}")


@dataclass(frozen=True, slots=True)
class WorkerConfig(FromFlags):
    """A prefill or decode worker's settings; each field's text is its --help."""

    # Declared by pdserve.engine_args.add_worker_args (external): defaults there, read here.
    bind: str = setting("127.0.0.1:0", "host:port to serve gRPC on", external=True)
    kvstore: str = setting("127.0.0.1:50070", "host:port of the KV store service", external=True)
    worker_id: str = setting("", "name in stats and logs (empty: host:port)", external=True)
    batch_window_s: float = setting(0.002, "after an idle spell, wait this long for more requests before the "
                                    "first step", flag="--batch-window-ms", scale=1e3, external=True)

    kv_write_back: bool = setting(True, "decode: write each block a sequence fills back to the kvstore "
                                  "(unpinned), so a resume elsewhere or the next turn finds it by prefix",
                                  env=WRITE_BACK_ENV)
    kv_shared_memory_mb: float = setting(64.0, "MiB of shared memory through which KV blocks move to and from "
                                         "a kvstore on this host (kvstore.shared_memory; 0: inside gRPC "
                                         "messages, as with a store elsewhere)", env=SHARED_MEMORY_ENV,
                                         metavar="MIB")
    residency_interval_s: float = setting(1.0, "decode: seconds between reports of the paged cache's blocks "
                                          "to the kvstore's residency index (the gateway routes by it)",
                                          env=RESIDENCY_INTERVAL_ENV, metavar="S")
    # Kubernetes' terminationGracePeriodSeconds must exceed it (plus the handover, pdserve.drain).
    drain_timeout_s: float = setting(30.0, "on SIGTERM: seconds running requests may take to finish before they "
                                     "are handed over to other workers (0: hand over at once)",
                                     env=DRAIN_TIMEOUT_ENV, metavar="S")
    collective_timeout_s: float = setting(30.0, "with --tensor-parallel-size > 1: seconds a collective may wait "
                                          "for the worker's other ranks before the worker fails (a dead rank "
                                          "fails it at once)", metavar="S")
    # Environment only: a test hook has no business in --help.
    engine_fault_after_steps: int = setting(0, "tests only: the engine fails its step after this many steps "
                                            "(0: never)", flag=None, env=ENGINE_FAULT_ENV)
    # Environment only: a secret never goes on a command line (ps shows those to every user).
    kv_mac_key: bytes = setting(b"", "the cluster KV MAC key (PDSERVE_KV_MAC_KEY or PDSERVE_KV_MAC_KEY_FILE; "
                                "empty: blocks go unsigned and are read unchecked)", flag=None,
                                load=kv_mac.key_from_env, repr=False)
    core_share: str = setting("", "a file the prefill and decode workers of one host share (pdserve.runtime."
                              "core_share; `pdserve up` gives one): a worker computes on --wide-threads "
                              "while no worker of the other kind does (empty: each keeps to --threads)",
                              metavar="PATH")
    core_share_slot: int = setting(0, "this worker's slot in --core-share (one per worker of its kind on the "
                                   "host)", metavar="N")
    wide_threads: int = setting(0, "with --core-share: torch threads while no worker of the other kind on the "
                                "host computes (0: --threads)", metavar="N")
    decode_yield_s: float = setting(0.0, "decode, with --core-share: while a prefill worker of the host "
                                    "computes and this worker's batch has room, leave the cores to it up to "
                                    "this long after each step (0: never)", flag="--decode-yield-ms",
                                    scale=1e3, metavar="MS")
    stream_interval: int = setting(1, "decode: tokens a stream's chunk holds before it is sent (the first "
                                   "token and the last go at once; vLLM's --stream-interval)", metavar="N")
    step_log_dir: str = setting("", "write one JSON line per engine step (wall and CPU ms, threads, sequences "
                                "decoded, prompt tokens, KV blocks loaded) to DIR/<kind>-<pid>.jsonl; "
                                "`pdserve step-log` summarizes them (empty: off)", env=STEP_LOG_DIR_ENV,
                                metavar="DIR")
    log_level: str = setting("INFO", "logging level", env=LOG_LEVEL_ENV, metavar="LEVEL")
    process: ProcessConfig = nested(ProcessConfig, "TLS, internal token, tracing and /metrics")

    def __post_init__(self) -> None:
        if not self.batch_window_s >= 0:  # also refuses NaN
            raise ValueError(f"--batch-window-ms must be >= 0, got {self.batch_window_s * 1e3:g}")
        check_decode_yield_ms(self.decode_yield_s * 1e3)
        if not self.residency_interval_s > 0:
            raise ValueError(f"--residency-interval-s / {RESIDENCY_INTERVAL_ENV} must be > 0 seconds, "
                             f"got {self.residency_interval_s:g}")
        check_stream_interval(self.stream_interval)
        if not 0 <= self.kv_shared_memory_mb <= 65536:  # also refuses NaN
            raise ValueError(f"--kv-shared-memory-mb must be in [0, 65536] MiB (0: off), "
                             f"got {self.kv_shared_memory_mb:g}")
        if not self.drain_timeout_s >= 0:  # also refuses NaN
            raise ValueError(f"--drain-timeout-s / {DRAIN_TIMEOUT_ENV} must be >= 0 seconds, "
                             f"got {self.drain_timeout_s:g}")
        if self.engine_fault_after_steps < 0:
            raise ValueError(f"{ENGINE_FAULT_ENV} must be a whole number of engine steps (0: never), "
                             f"got {self.engine_fault_after_steps}")
        kv_mac.check_key(self.kv_mac_key)
        check_log_level(self.log_level)


def add_arguments(parser: argparse.ArgumentParser, decode: bool = True) -> None:
    """The flags derived from WorkerConfig (those of engine_args.add_worker_args aside); a prefill
    worker (`decode` False) gets none of the decode-only ones."""
    add_flags(parser, WorkerConfig, skip=() if decode else DECODE_ONLY)

