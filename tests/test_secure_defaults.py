"""Secure defaults: standalone services and /metrics bind loopback, `pdserve up` generates the
internal token and the KV MAC key, a worker without a key says so, and no usage error echoes a
secret or takes an abbreviation for an option."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from gateway.server import DEFAULT_BIND, http_bind_of
from kvstore.server import parse_args as kvstore_parse_args
from pdserve import internal_auth, kv_mac
from pdserve.cli import build_parser, redact_usage_error
from pdserve.commands.up import cluster_secret_env, plan

SECRET = "sk-live-7c1f0a9e3b5d42e8a6f1"
SECRET_VARS = (internal_auth.TOKEN_ENV, internal_auth.TOKEN_FILE_ENV, kv_mac.KEY_ENV, kv_mac.KEY_FILE_ENV)


def _usage_error(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(argv)
    assert exit_.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("argv", [
    ["gateway", "--api-keys", SECRET],  # an abbreviation of --api-keys-file (--api-key is a flag of its own)
    ["gateway", f"--api-keys={SECRET}"],
    ["gateway", "--max-inflight", SECRET],
    ["up", "--prefill", "1", SECRET],
])
def test_usage_errors_never_echo_a_secret(capsys, argv: list[str]) -> None:
    err = _usage_error(capsys, argv)
    assert SECRET not in err and "sk-" not in err
    assert "--api-keys" in err or "--max-inflight" in err or "unrecognized" in err


def test_options_are_never_abbreviated(capsys) -> None:
    # --api-keys must not be read as --api-keys-file (which would then print the key as a path).
    err = _usage_error(capsys, ["gateway", "--api-keys", SECRET])
    assert "unrecognized arguments: --api-keys" in err
    _usage_error(capsys, ["up", "--prefil", "2"])


def test_redaction_keeps_what_a_person_needs() -> None:
    assert redact_usage_error("argument --kv-dtype: invalid choice: 'fp9'") == \
        "argument --kv-dtype: invalid choice: 'fp9'"
    assert redact_usage_error("unrecognized arguments: --foo x --bar") == \
        "unrecognized arguments: --foo --bar (1 value not shown)"


@pytest.mark.parametrize("argv", [["kvstore"], ["prefill"], ["decode"], ["gateway"]])
def test_standalone_services_bind_loopback_by_default(argv: list[str]) -> None:
    assert build_parser().parse_args(argv).bind.startswith("127.0.0.1:")


def test_module_entry_points_and_http_bind_loopback_by_default() -> None:
    assert kvstore_parse_args([]).bind.startswith("127.0.0.1:")
    assert DEFAULT_BIND.startswith("127.0.0.1:")
    assert http_bind_of(DEFAULT_BIND, 8000) == "127.0.0.1:8000"


_LISTEN_ADDRESS = """
import os
from pdserve.grpc_server import ProcessConfig, start_metrics_http
config = ProcessConfig.from_env(os.environ)  # as a service's main builds it
port = start_metrics_http(config.metrics_port, config.metrics_host)
for table in ("/proc/net/tcp", "/proc/net/tcp6"):
    for line in open(table).read().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
            print(local.rsplit(":", 1)[0])
"""


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads the kernel's socket table")
@pytest.mark.parametrize(("host", "address"), [(None, "0100007F"), ("0.0.0.0", "00000000")])
def test_metrics_bind_loopback_unless_told(host: str | None, address: str) -> None:
    env = {**os.environ, "PDSERVE_METRICS_PORT": "0"}
    env.pop("PDSERVE_METRICS_HOST", None)
    if host:
        env["PDSERVE_METRICS_HOST"] = host
    out = subprocess.run([sys.executable, "-c", _LISTEN_ADDRESS], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.split() == [address], out.stderr


def _plan_env(argv: list[str]) -> dict[str, dict[str, str]]:
    workers, gateway = plan(build_parser().parse_args(["up", *argv]))
    return {spec.name: dict(spec.env) for spec in [*workers, gateway]}


def test_up_generates_fresh_secrets_for_its_children(monkeypatch) -> None:
    for name in SECRET_VARS:
        monkeypatch.delenv(name, raising=False)
    first, second = _plan_env([]), _plan_env([])
    token = first["kvstore"][internal_auth.TOKEN_ENV]
    assert {env[internal_auth.TOKEN_ENV] for env in first.values()} == {token}
    assert second["kvstore"][internal_auth.TOKEN_ENV] != token  # random per `pdserve up`
    assert {name for name, env in first.items() if kv_mac.KEY_ENV in env} == {"prefill-0", "decode-0"}
    no_token = _plan_env(["--no-internal-token"])
    assert not any(internal_auth.TOKEN_ENV in env for env in no_token.values())
    assert kv_mac.KEY_ENV in no_token["decode-0"]  # the MAC is never switched off by that flag


def test_up_keeps_secrets_the_operator_set() -> None:
    environ = {internal_auth.TOKEN_FILE_ENV: "/run/secrets/internal-token", kv_mac.KEY_ENV: "k" * 32}
    assert cluster_secret_env(environ) == {}
    assert set(cluster_secret_env({})) == {internal_auth.TOKEN_ENV, kv_mac.KEY_ENV}


def _worker_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in SECRET_VARS}
    return {**env, "PDSERVE_LOG_LEVEL": "INFO", **extra}


def test_standalone_worker_without_a_key_warns_once() -> None:
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "prefill", "--bind", "127.0.0.1:0",
                             "--kvstore", "127.0.0.1:9", "--threads", "1"], env=_worker_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline, lines = time.monotonic() + 120, []
        while time.monotonic() < deadline and not any("listening on port" in line for line in lines):
            line = proc.stderr.readline()
            if not line:
                break
            lines.append(line)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    warnings = [line for line in lines if "KV blocks are unauthenticated" in line]
    assert len(warnings) == 1, "".join(lines)
    assert kv_mac.KEY_ENV in warnings[0]


def test_a_short_key_stops_a_worker_without_echoing_it() -> None:
    out = subprocess.run([sys.executable, "-m", "pdserve.cli", "decode", "--bind", "127.0.0.1:0",
                          "--kvstore", "127.0.0.1:9"], env=_worker_env(PDSERVE_KV_MAC_KEY="tooshort77"),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "at least 16" in out.stderr and "tooshort77" not in out.stderr


def test_secrets_command_creates_compose_secrets_once(tmp_path) -> None:
    run = [sys.executable, "-m", "pdserve.cli", "secrets", str(tmp_path / "s")]
    first = subprocess.run(run, capture_output=True, text=True, timeout=60)
    assert first.returncode == 0, first.stderr
    token, key = (tmp_path / "s" / "internal-token"), (tmp_path / "s" / "kv-mac-key")
    values = token.read_text(), key.read_text()
    assert len(values[0].strip()) == 64 and values[0] != values[1]
    assert token.stat().st_mode & 0o777 == 0o600
    assert values[0] not in first.stdout and values[1] not in first.stdout
    again = subprocess.run([*run, "--mode", "644"], capture_output=True, text=True, timeout=60)
    assert "exists, kept" in again.stdout and (token.read_text(), key.read_text()) == values


def test_a_second_grpc_server_on_a_taken_port_fails_to_bind_instead_of_sharing_it() -> None:
    # grpc binds with SO_REUSEPORT unless told not to: a second listener (ours planned wrong, or
    # another local process) would silently take part of the first one's connections.
    import asyncio

    from pdserve.grpc_server import start_server, stop_server

    async def both() -> str:
        first, port = await start_server("127.0.0.1:0", lambda s: None, ["pdserve.v1.Probe"])
        try:
            await start_server(f"127.0.0.1:{port}", lambda s: None, ["pdserve.v1.Probe"])
        except OSError as err:
            return str(err)
        finally:
            await stop_server(first, grace_s=0)
        return "bound twice"

    assert "cannot bind gRPC server to '127.0.0.1:" in asyncio.run(both())
