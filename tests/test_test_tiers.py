"""The `stack` tier is complete: every test in tests/*.py that starts real server processes is
marked (by tests/conftest.py's STACK_MODULES, STACK_FIXTURES or STACK_TESTS), so a new stack test
cannot land in the fast `pytest -m "not stack"` loop unmarked.

The scan is static (ast, no imports of the test modules). A top-level function, fixture or
module-level fixture assignment starts processes when it, or a helper it calls (in its module, or
imported from another tests/ module), does one of:
  - calls start_stack, Supervisor, RedisServer or RedisProcess;
  - calls subprocess (Popen, run, ...) in a function that builds a `pdserve ...` or
    `python -m <pdserve package>` command line;
  - runs in-process (main(...), args._run(args), <pdserve.commands module>.run(...)) an argv
    naming a pdserve command whose module starts processes (up, soak, bench-*, ...).
Each such test must then be marked, each such fixture named in STACK_FIXTURES; what is flagged
but starts nothing goes in NOT_STACK below, with the reason.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import STACK_FIXTURES, STACK_MODULES, STACK_TESTS, starts_processes

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
PACKAGES = {"pdserve", "gateway", "prefill", "decode", "kvstore"}  # what `python -m` could start
LAUNCHERS = {"start_stack", "Supervisor", "RedisServer", "RedisProcess"}
SUBPROCESS_CALLS = {"Popen", "run", "call", "check_call", "check_output", "create_subprocess_exec",
                    "create_subprocess_shell"}
COMMAND_LAUNCH = re.compile(r"start_stack\(|Supervisor\(|RedisProcess\(|subprocess\.|Popen\(")

# Flagged by the scan, but they start no process: "file::function": why.
NOT_STACK = {
    "test_bench.py::test_no_target_is_a_usage_error": "`pdserve bench` with no target: a usage error",
    "test_bench_disagg.py::test_bad_arms_are_a_usage_error": "refused while parsing --arms",
    "test_kvstore_tiers.py::test_unreachable_redis_at_start_still_serves": "a RedisServer never started",
    "test_loader.py::test_wrong_model_path_is_one_line_from_the_cli": "`pdserve up` refuses before a child",
    "test_up.py::test_a_bad_config_is_refused_before_anything_starts": "`pdserve up` refuses its config",
    "test_up.py::test_a_negative_decode_yield_is_refused_before_anything_starts": "`pdserve up` refuses the flag",
}


def stack_commands() -> set[str]:
    """The pdserve commands whose module starts processes (read from pdserve/commands/*.py)."""
    names = set()
    for path in (REPO / "pdserve" / "commands").glob("*.py"):
        source = path.read_text()
        for node in ast.parse(source).body:
            if (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "NAME" for t in node.targets)
                    and isinstance(node.value, ast.Constant) and COMMAND_LAUNCH.search(source)):
                names.add(node.value.value)
    return names


@dataclass
class Facts:
    """What one top-level definition does, on its own (before following its helpers)."""
    launcher: bool = False  # start_stack / Supervisor / RedisServer / RedisProcess
    subprocess: bool = False  # calls subprocess
    pdserve_argv: bool = False  # builds `pdserve ...` or `python -m <package>...`
    command_argv: bool = False  # an argv literal starting with a process-starting pdserve command
    runs_command: bool = False  # main(...), x._run(...), <command module>.run(...)
    calls: set[str] = field(default_factory=set)

    def starts(self) -> bool:
        return self.launcher or (self.subprocess and self.pdserve_argv) or (self.command_argv and self.runs_command)

    def merge(self, other: Facts) -> bool:
        before = (self.launcher, self.subprocess, self.pdserve_argv, self.command_argv, self.runs_command)
        self.launcher |= other.launcher
        self.subprocess |= other.subprocess
        self.pdserve_argv |= other.pdserve_argv
        self.command_argv |= other.command_argv
        self.runs_command |= other.runs_command
        return before != (self.launcher, self.subprocess, self.pdserve_argv, self.command_argv, self.runs_command)


def _callee(call: ast.Call) -> tuple[str | None, str | None]:
    """(receiver name or None, called name) of a call."""
    f = call.func
    if isinstance(f, ast.Name):
        return None, f.id
    if isinstance(f, ast.Attribute):
        return (f.value.id if isinstance(f.value, ast.Name) else ""), f.attr
    return None, None


def _facts(node: ast.AST, commands: set[str], command_modules: set[str]) -> Facts:
    facts = Facts()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call):
            receiver, name = _callee(sub)
            if name in LAUNCHERS:
                facts.launcher = True
            if name in SUBPROCESS_CALLS and (receiver in ("subprocess", "asyncio") or name == "Popen"):
                facts.subprocess = True
            if name == "main" or name == "_run" or (name == "run" and receiver in command_modules):
                facts.runs_command = True
            if receiver is None and name:
                facts.calls.add(name)
        elif isinstance(sub, (ast.List, ast.Tuple)):
            items = [e.value if isinstance(e, ast.Constant) and isinstance(e.value, str) else None for e in sub.elts]
            if items and items[0] == "pdserve":
                facts.pdserve_argv = True
            if any(a == "-m" and b and b.split(".")[0] in PACKAGES for a, b in zip(items, items[1:])):
                facts.pdserve_argv = True
            if items and items[0] in commands:
                facts.command_argv = True
    return facts


@dataclass
class Definition:
    module: str
    name: str
    kind: str  # "test", "fixture" or "helper"
    facts: Facts
    params: set[str]


def _is_fixture(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    for deco in node.decorator_list:
        target = deco.func if isinstance(deco, ast.Call) else deco
        if ast.unparse(target) in ("pytest.fixture", "fixture"):
            return True
    return False


def scan() -> dict[str, dict[str, Definition]]:
    """tests/*.py: every top-level definition, with what it and its helpers do."""
    commands = stack_commands()
    modules: dict[str, dict[str, Definition]] = {}
    imports: dict[str, dict[str, tuple[str, str]]] = {}  # module -> local name -> (tests module, name)
    local = {p.stem for p in TESTS.glob("*.py")}
    for path in sorted(TESTS.glob("*.py")):
        if path.name == Path(__file__).name:
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        command_modules = {alias.asname or alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                           and (node.module or "").startswith("pdserve.commands") for alias in node.names}
        defs: dict[str, Definition] = {}
        imports[path.name] = {}
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                kind = "fixture" if _is_fixture(node) else "test" if node.name.startswith("test") else "helper"
                params = {a.arg for a in node.args.args + node.args.kwonlyargs}
                facts = _facts(node, commands, command_modules)
                defs[node.name] = Definition(path.name, node.name, kind, facts, params)
            elif isinstance(node, ast.ClassDef):
                defs[node.name] = Definition(path.name, node.name, "helper", _facts(node, commands, command_modules),
                                             set())
            elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
                # `stack = stack_fixture(...)`: a fixture made by a factory (fuzz_support)
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        defs[target.id] = Definition(path.name, target.id, "fixture",
                                                     _facts(node.value, commands, command_modules), set())
            elif isinstance(node, ast.ImportFrom) and node.module in local:
                for alias in node.names:
                    imports[path.name][alias.asname or alias.name] = (f"{node.module}.py", alias.name)
        modules[path.name] = defs
    changed = True
    while changed:  # follow helpers to a fixed point, across tests/ modules
        changed = False
        for module, defs in modules.items():
            for definition in defs.values():
                for name in definition.facts.calls:
                    callee = defs.get(name)
                    if callee is None and name in imports[module]:
                        other, other_name = imports[module][name]
                        callee = modules.get(other, {}).get(other_name)
                    if callee is not None and callee is not definition:
                        changed |= definition.facts.merge(callee.facts)
    return modules


@pytest.fixture(scope="module")
def scanned() -> dict[str, dict[str, Definition]]:
    return scan()


def test_every_test_that_starts_processes_is_in_the_stack_tier(scanned) -> None:
    unmarked, stale_exemptions = [], []
    for module, defs in scanned.items():
        for d in defs.values():
            key = f"{module}::{d.name}"
            if not d.facts.starts():
                if key in NOT_STACK:
                    stale_exemptions.append(key)
                continue
            if module in STACK_MODULES or key in NOT_STACK:
                continue
            if d.kind == "fixture" and d.name not in STACK_FIXTURES:
                unmarked.append(f"{key} (a fixture: add it to STACK_FIXTURES in tests/conftest.py)")
            elif d.kind == "test" and key not in STACK_TESTS and STACK_FIXTURES.isdisjoint(d.params):
                unmarked.append(f"{key} (add it to STACK_TESTS, or its module to STACK_MODULES)")
    assert not unmarked, "tests that start processes but are not marked `stack`:\n" + "\n".join(unmarked)
    assert not stale_exemptions, f"NOT_STACK names tests the scan no longer flags: {stale_exemptions}"


def test_the_scan_finds_the_known_stack_starters(scanned) -> None:
    """The scan itself: each way of starting processes is recognised somewhere it is used."""
    def starts(module: str, name: str) -> bool:
        return scanned[module][name].facts.starts()
    assert starts("test_stack.py", "stack")  # start_stack in a fixture
    assert starts("redis_fixture.py", "redis_server")  # RedisServer
    assert starts("test_fuzz_http.py", "stack")  # a factory's fixture from fuzz_support
    assert starts("test_up.py", "test_supervisor_startup_timeout_names_the_child")  # Supervisor
    assert starts("test_secure_defaults.py", "test_secrets_command_creates_compose_secrets_once")  # argv in a variable
    assert starts("test_up_supervisor.py", "test_killing_up_leaves_no_orphans")  # through the _up helper
    assert starts("test_soak.py", "test_soak_with_a_decode_kill_keeps_the_invariants")  # main(["soak", ...])
    assert starts("test_bench_disagg.py", "test_tiny_run_on_real_stacks")  # argv from a helper, then _run
    assert not starts("test_dtype.py", "test_pdserve_up_passes_one_resolved_dtype_to_every_child")  # plan() only
    assert not starts("test_k8s.py", "test_placeholder_secrets_are_refused_at_start")  # `python -c`, not pdserve
    assert {"up", "soak", "bench-overload"} <= stack_commands()


def test_the_sets_name_what_exists(scanned) -> None:
    """No stale entries: every module, test and fixture the sets name is still there."""
    assert not [m for m in STACK_MODULES if m not in scanned], "STACK_MODULES names a missing module"
    missing = [key for key in STACK_TESTS if key.split("::")[1] not in scanned.get(key.split("::")[0], {})]
    assert not missing, f"STACK_TESTS names missing tests: {missing}"
    fixtures = {d.name for defs in scanned.values() for d in defs.values() if d.kind == "fixture"}
    assert not STACK_FIXTURES - fixtures, f"STACK_FIXTURES names no fixture: {STACK_FIXTURES - fixtures}"


def test_the_marker_is_registered_and_put_on_by_the_hook(pytestconfig, request) -> None:
    assert any(line.startswith("stack:") for line in pytestconfig.getini("markers"))

    def item(path: str, name: str, *fixtures: str) -> SimpleNamespace:
        return SimpleNamespace(path=TESTS / path, originalname=name, fixturenames=list(fixtures))
    assert starts_processes(item("test_stack.py", "test_anything"))  # by module
    assert starts_processes(item("test_http_api.py", "test_sse_framing_bytes", "stack"))  # by fixture
    assert starts_processes(item("test_http_api.py", "test_errors", "client", "stack"))  # through a fixture
    assert starts_processes(item("test_soak.py", "test_soak_with_a_decode_kill_keeps_the_invariants", "tmp_path"))
    assert not starts_processes(item("test_soak.py", "test_due_keeps_the_gap_in_its_own_unit"))
    assert not starts_processes(item("test_http_api.py", "test_no_workers_503", "monkeypatch"))
    for collected in request.session.items:  # what this run collected carries the marker iff it should
        assert (collected.get_closest_marker("stack") is not None) == starts_processes(collected), collected.nodeid
