"""`pdserve soak`: thousands of requests against a real stack while its processes are killed and
restarted, then the invariants that must survive that.

    stack (2 prefill, 2 decode, kvstore, optional Redis tier) -> N greedy requests on a few prompts
    with known reference outputs, `--concurrency` at a time, some cancelled by the client, while
    the fault schedule (triggered by time or by progress: requests ended, tokens streamed) SIGKILLs
    and restarts workers, the kvstore or Redis, cancels bursts of long requests during their
    prefill, and forges KV blocks -> every dead process restarted -> quiet: KV accounting polled on
    every worker and the kvstore -> invariants

Invariants (exit 1 when one fails): every request sent has exactly one outcome (none lost, none
duplicated, no chunk with another id or after the end); a completed stream equals its reference
and a cancelled or failed one is a prefix of it; every failure is a documented status (UNAVAILABLE,
RESOURCE_EXHAUSTED, DEADLINE_EXCEEDED) with a message; KV free == total with nothing running on
every worker and nothing pinned in the kvstore; no process that was never restarted grew its RSS
by more than --rss-growth-limit-mb; requests that followed forged KV blocks equal their reference;
every fault of --faults ran. Prints a table, and the JSON report with --json.
"""

from __future__ import annotations

import argparse
import random
import re
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the command imports its heavy parts only when it runs
    from pdserve.runtime.kv_format import KVFormat
    from pdserve.redis_process import RedisProcess
    from pdserve.runtime.engine import Engine
    from pdserve.runtime.loader import Checkpoint
    from pdserve.soak.attacks import AttackLog
    from pdserve.soak.workload import LoadLog
    from pdserve.stack import Stack
from pathlib import Path

NAME = "soak"
HELP = "run many requests against a stack under injected faults and check the invariants"


SOAK_MODEL = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "stories260K" / "stories260K.gguf"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=2000, help="requests to send")
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight at once")
    p.add_argument("--duration-s", type=float, default=900, help="stop sending new requests after this long")
    p.add_argument("--cancel-rate", type=float, default=0.1, help="share of requests the client cancels")
    p.add_argument("--faults", default="",
                   help="schedule, e.g. kill:decode-0@20r,restart:decode-0@+10r,cancel-during-prefill@30r,poison@500t "
                        "(@Ns seconds, @Nr requests ended, @Nt tokens streamed; @+N: after the previous fault)")
    p.add_argument("--fault-every-s", type=float, default=0,
                   help="random schedule: kill one target every N seconds (0: only --faults)")
    p.add_argument("--fault-down-s", type=float, default=3, help="random schedule: seconds before the restart")
    p.add_argument("--fault-targets", default="decode,prefill,kvstore,redis,cancel-during-prefill,poison",
                   help="random schedule: kinds of process to kill (redis only with --redis) and load faults")
    p.add_argument("--prefill-cancel-burst", type=int, default=6,
                   help="cancel-during-prefill: long requests per burst, cancelled after 0, 1, ... prefill steps")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="compute dtype of the stack and of the reference engine alike (default float32: the "
                        "reference must be what the stack computes, and `auto` could differ between them)")
    p.add_argument("--model", default=str(SOAK_MODEL),
                   help="model every process serves (default: the repository's stories260K fixture; a soak is "
                        "about request counts and faults, not model speed)")
    p.add_argument("--prefill", type=int, default=2, help="prefill workers")
    p.add_argument("--decode", type=int, default=2, help="decode workers")
    p.add_argument("--redis", action="store_true", help="give the kvstore a Redis tier (runs redis-server)")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload and the random schedule")
    p.add_argument("--request-timeout-s", type=float, default=60, help="deadline of each request")
    p.add_argument("--quiet-timeout-s", type=float, default=150,
                   help="how long to wait for KV to be released after the load (the kvstore's lease TTL is 120 s)")
    p.add_argument("--rss-growth-limit-mb", type=float, default=256, help="most RSS growth per process")
    p.add_argument("--json", default=None, metavar="PATH", help="write the JSON report here ('-': stdout)")


def run(args: argparse.Namespace) -> int:
    from pdserve.soak.faults import parse_faults

    try:
        faults = parse_faults(args.faults)
    except ValueError as err:
        print(f"pdserve soak: --faults: {err}", file=sys.stderr)
        return 2
    known = {"kvstore", *(f"prefill-{i}" for i in range(args.prefill)), *(f"decode-{i}" for i in range(args.decode)),
             *(["redis"] if args.redis else [])}
    unknown = sorted({f.target for f in faults if f.target} - known)
    if unknown:
        print(f"pdserve soak: --faults names {', '.join(unknown)}; the targets are {', '.join(sorted(known))}",
              file=sys.stderr)
        return 2
    if args.requests < 1 or args.concurrency < 1 or args.prefill_cancel_burst < 1 or not 0 <= args.cancel_rate <= 1:
        print("pdserve soak: --requests, --concurrency and --prefill-cancel-burst must be >= 1, "
              "--cancel-rate in [0, 1]", file=sys.stderr)
        return 2
    report = soak(args, faults)
    print_table(report)
    if args.json:
        from pdserve.commands.output import write_json
        write_json(args.json, report)
    return 0 if report["passed"] else 1


def references(max_tokens: int, model: str, dtype: str) -> tuple[list[list[int]], Checkpoint, Engine]:
    """The in-process engine's greedy output for each prompt of ALL_PROMPTS, and the engine."""
    from pdserve.runtime.config import CacheConfig, EngineConfig
    from pdserve.runtime.engine import Engine
    from pdserve.runtime.loader import load_checkpoint, resolve_model_path
    from pdserve.runtime.sampling_params import SamplingParams
    from pdserve.soak.workload import ALL_PROMPTS

    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: more threads only fight the stack's processes for the cores
    try:
        checkpoint = load_checkpoint(resolve_model_path(model), dtype=getattr(torch, dtype))
        engine = Engine.from_checkpoint(checkpoint, EngineConfig(cache=CacheConfig(dtype=dtype), dtype=dtype))
        prompts = [checkpoint.tokenizer.encode(p) for p in ALL_PROMPTS]
        outputs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0))
    finally:  # the caller's setting back: soak runs inside other processes too (the test suite)
        torch.set_num_threads(threads)
    return [r.output_ids for r in outputs], checkpoint, engine


@dataclass
class FaultContext:
    """What `apply_fault` acts on: the stack, its Redis, the load's log, and what the load faults need."""

    stack: Stack
    redis: RedisProcess | None
    log: LoadLog | None  # set when the load starts
    attacks: AttackLog | None  # likewise
    checkpoint: Checkpoint  # its tokenizer hashes the poisoned prompts
    block_spec: KVFormat  # of the stack's KV: what a forged block must look like
    burst: int  # --prefill-cancel-burst


def soak(args: argparse.Namespace, faults: list) -> dict:
    """Start everything, run the load under the faults, check; the report (JSON-ready)."""
    from pdserve.redis_process import RedisProcess
    from pdserve.soak.workload import LENGTHS
    from pdserve.stack import start_stack

    phases = Phases()
    refs, checkpoint, engine = references(max(LENGTHS), args.model, args.dtype)
    phases.mark("references")
    redis = RedisProcess().start() if args.redis else None
    stack = start_stack(args.prefill, args.decode, "--model", args.model, "--dtype", args.dtype,
                        *(("--kv-backend", redis.url) if redis else ()))
    phases.mark("start")
    try:
        result = load_and_check(args, faults, FaultContext(stack, redis, None, None, checkpoint, _block_spec(engine),
                                                            args.prefill_cancel_burst), phases)
    finally:
        stack.stop()
        if redis is not None:
            redis.kill()
    phases.mark("stop")
    return build_report(args, phases, refs, faults, result)


def _block_spec(engine: Engine) -> KVFormat:
    return engine.kv_format


def load_and_check(args: argparse.Namespace, faults: list, ctx: FaultContext, phases: Phases) -> dict:
    """The load under the fault schedule, then every process revived and the quiet-stack checks."""
    from pdserve.soak.attacks import AttackLog
    from pdserve.soak.faults import FaultRunner, random_schedule
    from pdserve.soak.invariants import kv_checks, kv_problems, rss_by_child, wait_quiet
    from pdserve.soak.workload import LoadLog, make_specs

    rng = random.Random(args.seed)
    stack = ctx.stack
    ctx.log, ctx.attacks = LoadLog(stack.gateway_stub, args.request_timeout_s), AttackLog()
    if args.fault_every_s > 0:  # time-based: the random schedule is for long soaks, where time is what is asked
        faults = [*faults, *random_schedule(args.fault_every_s, args.duration_s,
                                            fault_targets(stack, args, ctx.redis), rng, args.fault_down_s)]
        if all(f.unit == "s" and not f.relative for f in faults):
            faults.sort(key=lambda f: f.at)
    rss_before = rss_by_child(stack)
    runner = FaultRunner(faults, lambda f: apply_fault(ctx, f), ctx.log.progress)
    specs = make_specs(args.requests, args.cancel_rate, rng)
    runner.start()
    run_load(ctx.log, specs, args.concurrency, args.duration_s)
    phases.mark("load")
    runner.stop()
    ctx.attacks.join()  # a burst still running ends by its requests' own deadline
    revived = revive(stack, ctx.redis)
    phases.mark("revive")
    first = kv_problems(kv_checks(stack))  # what the quiet wait waits for (leases expire in 120 s)
    checks = wait_quiet(stack, args.quiet_timeout_s)
    phases.mark("quiet")
    return {"log": ctx.log, "attacks": ctx.attacks, "runner": runner, "revived": revived, "checks": checks,
            "kv_held_after_load": first, "rss_before": rss_before, "rss_after": rss_by_child(stack)}


class Phases:
    """Seconds each phase of the soak took (start, load, ...), for the report."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.monotonic()

    def mark(self, name: str) -> None:
        now = time.monotonic()
        self.seconds[name] = round(now - self._last, 1)
        self._last = now


def fault_targets(stack, args: argparse.Namespace, redis) -> list[str]:
    from pdserve.soak.faults import LOAD_ACTIONS

    kinds = {k.strip() for k in args.fault_targets.split(",") if k.strip()}
    names = [c.spec.name for c in stack.workers if c.spec.name.split("-")[0] in kinds]
    return (names + (["redis"] if redis is not None and "redis" in kinds else [])
            + [a for a in LOAD_ACTIONS if a in kinds])


def apply_fault(ctx: FaultContext, fault) -> None:
    from pdserve.soak import attacks

    print(f"pdserve soak: {fault} (in flight: {ctx.log.progress.in_flight})", file=sys.stderr, flush=True)
    if fault.action == "cancel-during-prefill":
        ctx.attacks.start(attacks.cancel_during_prefill, ctx.log, ctx.stack, ctx.attacks, ctx.burst)
    elif fault.action == "poison":
        ctx.attacks.start(attacks.poison, ctx.log, ctx.stack, ctx.attacks, ctx.checkpoint.tokenizer,
                          ctx.block_spec, ctx.stack.args.kv_dtype)
    elif fault.target == "redis":
        if ctx.redis is None:
            raise ValueError("no Redis tier (run with --redis)")
        ctx.redis.kill() if fault.action == "kill" else ctx.redis.start()
    elif fault.action == "kill":
        ctx.stack.kill(fault.target)
    else:
        ctx.stack.restart(fault.target)


def revive(stack, redis) -> list[str]:
    """Restart whatever the schedule left dead, so that the invariants can be read everywhere."""
    dead = [c.spec.name for c in stack.workers if c.proc.poll() is not None]
    for name in dead:
        stack.restart(name)
    if redis is not None and not redis.running:
        redis.start()
        dead.append("redis")
    return dead


def run_load(log: LoadLog, specs: Sequence, concurrency: int, duration_s: float) -> None:
    """Send `specs` from `concurrency` threads until done or `duration_s` passed, into `log`."""
    pending = iter(specs)
    lock = threading.Lock()

    def worker() -> None:
        stub = log.stub_factory()
        while log.progress.elapsed_s() < duration_s:
            with lock:
                spec = next(pending, None)
            if spec is None:
                return
            log.run(spec, stub)

    threads = [threading.Thread(target=worker, name=f"soak-client-{i}") for i in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _in_fault_window(outcome, events, grace_s: float = 5.0) -> bool:
    windows = [(e.started_s, e.ended_s + grace_s) for e in events]
    return any(outcome.started_s <= end and outcome.ended_s >= start for start, end in windows)


def _shorten(details: str) -> str:
    """A failure message without its addresses and request ids, so that alike ones count together."""
    return re.sub(r"(\d+\.){3}\d+:\d+|soak-[0-9a-f-]+", "*", details)[:160]


def build_report(args, phases: Phases, refs, faults: list, result: dict) -> dict:
    from pdserve.soak.invariants import kv_problems
    from pdserve.soak.ledger import check_ledger

    log, runner, checks = result["log"], result["runner"], result["checks"]
    ledger = check_ledger(log.sent, log.outcomes, refs)
    failed = [o for o in log.outcomes if o.status not in ("OK", "CANCELLED")]
    rss, grown = _rss_report(args, result["rss_before"], result["rss_after"])
    attacks = result["attacks"].report()
    not_run = [str(f) for f in runner.not_run if f in faults]  # only --faults items must all run
    invariants = {
        "none lost, none duplicated": not ledger.lost and not ledger.duplicated,
        "tokens equal the reference": not ledger.wrong_tokens,
        "only documented statuses": not ledger.undocumented,
        "KV free == total everywhere": not kv_problems(checks),
        f"RSS growth <= {args.rss_growth_limit_mb:g} MiB": not grown,
        f"forged KV ({attacks['forged_stored']} blocks) left outputs unchanged": not ledger.wrong_by_kind.get("poison"),
        "every --faults item ran": not not_run,
    }
    problems = (ledger.problems() + kv_problems(checks) + [f"RSS grew: {g}" for g in grown]
                + ([f"faults never triggered (the load ended first): {', '.join(not_run)}"] if not_run else []))
    return {
        "config": {k: v for k, v in vars(args).items() if not k.startswith("_") and k != "command"},
        "load_s": phases.seconds["load"], "phases_s": phases.seconds, "sent": ledger.sent,
        "outcomes": len(log.outcomes), "by_status": ledger.by_status, "by_kind": ledger.by_kind,
        "wrong_by_kind": ledger.wrong_by_kind, "completed_exact": ledger.completed_exact,
        "failed_outside_fault_windows": sum(not _in_fault_window(o, runner.events) for o in failed),
        "failure_details": dict(Counter(f"{o.status}: {_shorten(o.details)}" for o in failed).most_common(8)),
        "problems": problems, "faults": [_event_report(e) for e in runner.events], "faults_not_run": not_run,
        "attacks": attacks, "revived_at_end": result["revived"], "kv_held_after_load": result["kv_held_after_load"],
        "kv": [asdict(c) for c in checks], "rss": rss, "invariants": invariants, "passed": all(invariants.values()),
    }


def _event_report(e) -> dict:
    return {**asdict(e.fault), "fault": str(e.fault), "started_s": round(e.started_s, 2),
            "ended_s": round(e.ended_s, 2), "in_flight": e.in_flight, "error": e.error}


def _rss_report(args, rss_before: dict, rss_after: dict) -> tuple[dict, list[str]]:
    """Per process: RSS before and after, growth of those never restarted; and the ones over the limit."""
    rss = {}
    for name, (pid, before) in rss_before.items():
        pid_after, after = rss_after.get(name, (None, None))
        same = pid_after == pid and before is not None and after is not None
        rss[name] = {"before_mib": before, "after_mib": after, "restarted": pid_after != pid,
                     "growth_mib": round(after - before, 1) if same else None}
    grown = [f"{n} +{r['growth_mib']} MiB" for n, r in rss.items()
             if r["growth_mib"] is not None and r["growth_mib"] > args.rss_growth_limit_mb]
    return rss, grown


def print_table(r: dict) -> None:
    print(f"soak: {r['sent']} requests sent in {r['load_s']} s, {r['outcomes']} outcomes, "
          f"{r['completed_exact']} completed equal to the reference")
    print("  phases (s): " + ", ".join(f"{k} {v}" for k, v in r["phases_s"].items()))
    print("  " + ", ".join(f"{k} {v}" for k, v in sorted(r["by_status"].items())) +
          f"; failed outside fault windows: {r['failed_outside_fault_windows']}")
    if r.get("kv_held_after_load"):
        print(f"  KV still held when the load ended (released within {r['phases_s']['quiet']} s): "
              + "; ".join(r["kv_held_after_load"]))
    print(f"  faults: {len(r['faults'])} run, {sum(bool(f['error']) for f in r['faults'])} failed"
          + (f", {len(r['faults_not_run'])} never triggered" if r["faults_not_run"] else "")
          + (f"; revived at the end: {', '.join(r['revived_at_end'])}" if r["revived_at_end"] else ""))
    for f in r["faults"]:
        print(f"    {f['fault']:<32} at {f['started_s']:>7} s, {f['in_flight']:>3} in flight"
              + (f"  FAILED: {f['error']}" if f["error"] else ""))
    a = r["attacks"]
    print(f"  load faults: {a['prefill_cancels']} requests cancelled during prefill in {a['prefill_cancel_bursts']} "
          f"bursts; {a['forged_stored']} forged KV blocks stored ({a['forged_already_present']} refused as present), "
          f"{r['by_kind'].get('poison', 0)} requests after them, {r['wrong_by_kind'].get('poison', 0)} wrong")
    print(f"  {'process':<10} {'KV total':>12} {'free':>12} {'cached':>8} {'RSS MiB before':>15} {'after':>8}  problem")
    for c in r["kv"]:
        m = r["rss"].get(c["name"], {})
        before, after = m.get("before_mib"), m.get("after_mib")
        print(f"  {c['name']:<10} {c['total']:>12} {c['free']:>12} {c['cached']:>8} "
              f"{before if before is None else round(before):>15} {after if after is None else round(after):>8}"
              f"{' (restarted)' if m.get('restarted') else ''}  {c['problem'] or 'ok'}")
    for detail, n in r["failure_details"].items():
        print(f"    {n:>5} x {detail}")
    for name, ok in r["invariants"].items():
        print(f"  [{'PASS' if ok else 'FAIL'}] {name}")
    for p in r["problems"]:
        print(f"    - {p}")
