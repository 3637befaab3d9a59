"""Conditional disaggregation: which requests pay for a prefill worker, and which are prefilled by
the decode worker itself (the `PrefillPlacement` policies beyond `AlwaysRemote`).

Disaggregation keeps long prefills off the decode workers, so their running batches are not
stalled; the price is a hop (the Prefill call, the KV put to the store, the decode worker's get)
and a wait in the prefill queue. For a short prompt the hop costs more than the compute, and
under a burst of long prompts the prefill queue can cost more than computing on the decode worker.
`ConditionalPlacement` decides per request, in this order:

  1. no healthy prefill worker                       -> local (the only way left)
  2. the decode worker is busy: max(running, in flight) >= busy_fraction * decode_batch
                                                     -> remote (protect its batch)
  3. uncached prompt tokens <= local_max_tokens      -> local (the hop costs more than the compute)
  4. estimated remote TTFT > estimated local cost    -> local (the prefill queue is too long)
  5. otherwise                                       -> remote

The estimates (seconds; n = uncached prompt tokens, t = prefill seconds per token):

  remote = queue + overhead + n * t        queue = (prefill in flight / healthy prefill workers)
                                                   * mean uncached tokens of remote requests * t
  local  = n * t * (1 + penalty * (1 + load / decode_batch))        load = the decode worker's
                                                                    max(running, in flight)

`penalty` charges a local prefill for the decode steps it stalls (1: the running batch loses as
much time as the prompt takes; it grows with the batch), which is what keeps long prompts remote
on an idle cluster. `t` starts from the configured value and follows an EWMA of the remote
prefills the flow reports (`observe_prefill`); the mean remote prompt is an EWMA of the
prompts this policy sent remote. `CountedPlacement` counts every decision in
pdserve_prefill_placement_total{placement}.

The gateway's `--disagg-policy` (default always-remote: see docs/disaggregation.md for the
measurements behind that) and these thresholds are part of its config
(`gateway.config.GatewayConfig.disagg_policy` and `.disagg`); each deployment's flow gets its own
policy, built by `make_placement` (`gateway.server.build_flow`).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from gateway.placement import AlwaysRemote, Placement, PlacementInputs, PrefillPlacement
from pdserve.config_flags import add_flags, build, setting

POLICIES = ("always-remote", "always-local", "conditional")
DEFAULT_POLICY = "always-remote"  # conditional was not better on every number (docs/disaggregation.md)
MIN_S_PER_TOKEN = 1e-7  # floor of the learned prefill time (a prefill is never free)


@dataclass(frozen=True, slots=True)
class DisaggConfig:
    """The conditional policy's thresholds and cost constants (--help: each field's text)."""

    local_max_tokens: int = setting(64, "conditional: prompts with at most this many uncached tokens are "
                                    "prefilled on the decode worker", flag="--local-prefill-max-tokens")
    busy_fraction: float = setting(0.75, "conditional: a decode worker running this fraction of "
                                   "--disagg-decode-batch sequences gets no local prefill",
                                   flag="--disagg-busy-fraction")
    decode_batch: int = setting(32, "conditional: the decode workers' --max-batch-size",
                                flag="--disagg-decode-batch")
    prefill_s_per_token: float = setting(5e-4, "conditional: initial estimate of prefill compute per prompt "
                                         "token (then learned)", flag="--disagg-prefill-ms-per-token", scale=1e3)
    remote_overhead_s: float = setting(0.02, "conditional: fixed cost of prefilling remotely (Prefill call, KV "
                                       "put and get)", flag="--disagg-remote-overhead-ms", scale=1e3)
    local_penalty: float = setting(1.0, "decode-batch stall charged to a local prefill, in prefill times",
                                   flag=None)
    ewma_alpha: float = setting(0.2, "weight of the newest observation in the EWMAs", flag=None)

    def __post_init__(self) -> None:
        if self.local_max_tokens < 0:
            raise ValueError(f"--local-prefill-max-tokens must be >= 0, got {self.local_max_tokens}")
        if not 0 < self.busy_fraction <= 1:
            raise ValueError(f"--disagg-busy-fraction must be in (0, 1], got {self.busy_fraction}")
        if self.decode_batch < 1:
            raise ValueError(f"--disagg-decode-batch must be >= 1, got {self.decode_batch}")
        if self.prefill_s_per_token <= 0 or self.remote_overhead_s < 0 or self.local_penalty < 0:
            raise ValueError("--disagg-prefill-ms-per-token must be > 0, --disagg-remote-overhead-ms "
                             "and the local penalty >= 0")
        if not 0 < self.ewma_alpha <= 1:
            raise ValueError(f"ewma_alpha must be in (0, 1], got {self.ewma_alpha}")


class Ewma:
    """Exponentially weighted moving average, starting at `value`."""

    def __init__(self, value: float, alpha: float) -> None:
        self.value = value
        self.alpha = alpha

    def update(self, sample: float) -> float:
        self.value += self.alpha * (sample - self.value)
        return self.value


class AlwaysLocal:
    """Every prompt is prefilled by its decode worker (no prefill worker is ever used)."""

    def place(self, inputs: PlacementInputs) -> Placement:
        return "local"


class ConditionalPlacement:
    """Local for short prompts and long prefill queues, remote otherwise (see the module docstring)."""

    def __init__(self, config: DisaggConfig | None = None) -> None:
        self.config = config or DisaggConfig()
        c = self.config
        self.s_per_token = Ewma(c.prefill_s_per_token, c.ewma_alpha)
        self.remote_tokens = Ewma(float(max(c.local_max_tokens, 1)), c.ewma_alpha)

    def place(self, inputs: PlacementInputs) -> Placement:
        placement = self._decide(inputs)
        if placement == "remote":
            self.remote_tokens.update(inputs.uncached_tokens)
        return placement

    def _decide(self, inputs: PlacementInputs) -> Placement:
        c = self.config
        if inputs.prefill_healthy <= 0:
            return "local"
        if decode_load(inputs) >= c.busy_fraction * c.decode_batch:
            return "remote"
        if inputs.uncached_tokens <= c.local_max_tokens:
            return "local"
        return "local" if self.remote_seconds(inputs) > self.local_seconds(inputs) else "remote"

    def remote_seconds(self, inputs: PlacementInputs) -> float:
        """Estimated TTFT through a prefill worker: queue wait + hop + compute."""
        t = self.s_per_token.value
        queue_per_worker = inputs.prefill_inflight / max(inputs.prefill_healthy, 1)
        queue_s = queue_per_worker * self.remote_tokens.value * t
        return queue_s + self.config.remote_overhead_s + inputs.uncached_tokens * t

    def local_seconds(self, inputs: PlacementInputs) -> float:
        """Estimated cost of prefilling on the decode worker: compute + the stall it imposes."""
        c = self.config
        compute_s = inputs.uncached_tokens * self.s_per_token.value
        return compute_s * (1 + c.local_penalty * (1 + decode_load(inputs) / c.decode_batch))

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """Learn the per-token prefill time from one remote prefill of `tokens` uncached tokens
        that took `seconds` (the flow reports them); prompts up to the local threshold teach
        nothing: their time is mostly the fixed overhead."""
        if tokens > max(self.config.local_max_tokens, 0) and seconds > 0:
            compute_s = max(seconds - self.config.remote_overhead_s, 0.0)
            self.s_per_token.update(max(compute_s / tokens, MIN_S_PER_TOKEN))


def decode_load(inputs: PlacementInputs) -> int:
    """Sequences on the chosen decode worker: its last Stats, or the gateway's fresher count."""
    return max(inputs.decode_running, inputs.decode_inflight)


class CountedPlacement:
    """Wraps a policy and counts its decisions in pdserve_prefill_placement_total{placement}."""

    def __init__(self, inner: PrefillPlacement) -> None:
        self.inner = inner

    def place(self, inputs: PlacementInputs) -> Placement:
        from gateway.metrics import PREFILL_PLACEMENT

        placement = self.inner.place(inputs)
        PREFILL_PLACEMENT.labels(placement=placement).inc()
        return placement

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        observe = getattr(self.inner, "observe_prefill", None)
        if observe is not None:
            observe(tokens, seconds)


def make_placement(policy: str, config: DisaggConfig | None = None) -> CountedPlacement:
    """The named policy (one of POLICIES), counted; ValueError naming the choices otherwise."""
    if policy == "always-remote":
        inner: PrefillPlacement = AlwaysRemote()
    elif policy == "always-local":
        inner = AlwaysLocal()
    elif policy == "conditional":
        inner = ConditionalPlacement(config)
    else:
        raise ValueError(f"--disagg-policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    return CountedPlacement(inner)


# ---- flags --------------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser, decode_batch_flag: bool = True) -> None:
    """The placement flags (--disagg-policy and DisaggConfig's, defaults from GatewayConfig);
    `pdserve up` passes decode_batch_flag=False: it knows the decode workers' --max-batch-size."""
    from gateway.config import GatewayConfig  # it holds DisaggConfig: imported here, not above

    add_flags(p, GatewayConfig, only=("disagg_policy", "disagg"),
              skip=() if decode_batch_flag else ("disagg.decode_batch",))


def config_from_args(args: argparse.Namespace) -> DisaggConfig:
    """DisaggConfig from add_arguments' flags; ValueError with the flag's name when one is bad."""
    return build(DisaggConfig, args, {})


def placement_from_args(args: argparse.Namespace) -> CountedPlacement:
    return make_placement(args.disagg_policy, config_from_args(args))


def gateway_flags(args: argparse.Namespace, decode_batch: int) -> tuple[str, ...]:
    """The placement flags as a gateway command line (`pdserve up` forwards its own)."""
    return ("--disagg-policy", args.disagg_policy,
            "--local-prefill-max-tokens", str(args.local_prefill_max_tokens),
            "--disagg-busy-fraction", str(args.disagg_busy_fraction),
            "--disagg-decode-batch", str(decode_batch),
            "--disagg-prefill-ms-per-token", str(args.disagg_prefill_ms_per_token),
            "--disagg-remote-overhead-ms", str(args.disagg_remote_overhead_ms))


__all__ = ["AlwaysLocal", "ConditionalPlacement", "CountedPlacement", "DisaggConfig", "POLICIES",
           "add_arguments", "config_from_args", "make_placement", "placement_from_args"]
