"""compose.yaml: valid against the Compose spec, and every pdserve service runs a real
subcommand whose flags parse, health-checks the port it binds, and waits for what it needs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gateway.targets import parse_target
from pdserve.cli import build_parser

REPO = Path(__file__).resolve().parents[1]
COMPOSE = REPO / "compose.yaml"


@pytest.fixture(scope="module")
def services() -> dict:
    return yaml.safe_load(COMPOSE.read_text())["services"]


def test_compose_matches_the_compose_spec() -> None:
    checker = Path(sys.executable).parent / "check-jsonschema"
    result = subprocess.run([str(checker), "--builtin-schema", "vendor.compose-spec", str(COMPOSE)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_service_commands_are_pdserve_subcommands(services: dict) -> None:
    parser = build_parser()
    pdserve_services = {name: svc for name, svc in services.items() if name != "redis"}
    assert set(pdserve_services) == {"kvstore", "prefill", "decode", "gateway"}
    for name, svc in pdserve_services.items():
        command = svc["command"]
        try:
            args = parser.parse_args(command)
        except SystemExit:
            pytest.fail(f"service {name}: `pdserve {' '.join(command)}` does not parse")
        assert args.command == command[0], name
        port = args.bind.rsplit(":", 1)[1]
        assert svc["healthcheck"]["test"][-1] == f"127.0.0.1:{port}", f"{name} health-checks another port"
        assert svc["healthcheck"]["test"][1:4] == ["python", "-m", "pdserve.healthcheck"]
        assert all(dep["condition"] == "service_healthy" for dep in svc["depends_on"].values()), name


def test_gateway_reaches_every_replica(services: dict) -> None:
    args = build_parser().parse_args(services["gateway"]["command"])
    for kind in ("prefill", "decode"):
        target = parse_target(getattr(args, kind))
        assert target.resolve_all and target.host == kind  # one endpoint per replica
        bind = build_parser().parse_args(services[kind]["command"]).bind
        assert target.port == int(bind.rsplit(":", 1)[1])
        assert services[kind]["deploy"]["replicas"] == 2
    assert args.kvstore.rsplit(":", 1)[1] == build_parser().parse_args(services["kvstore"]["command"]).bind.rsplit(":", 1)[1]


def test_redis_is_a_bounded_lru_cache(services: dict) -> None:
    command = services["redis"]["command"]
    assert services["redis"]["image"] == "redis:7"
    assert "--maxmemory" in command and command[command.index("--maxmemory-policy") + 1] == "allkeys-lru"


def _compose_env(svc: dict) -> dict:
    """A service's environment with ${VAR:-default} read as its default (nothing set by the caller)."""
    import re

    return {k: re.sub(r"\$\{[A-Z_]+:?-([^}]*)\}", r"\1", str(v)) for k, v in svc["environment"].items()}


def test_secrets_are_on_by_default_and_only_readers_get_the_kv_mac_key(services: dict) -> None:
    top = yaml.safe_load(COMPOSE.read_text())["secrets"]
    assert set(top) == {"internal-token", "kv-mac-key"}
    for name in ("kvstore", "prefill", "decode", "gateway"):
        svc, env = services[name], _compose_env(services[name])
        assert "internal-token" in svc["secrets"], name
        assert env["PDSERVE_INTERNAL_TOKEN_FILE"] == "/run/secrets/internal-token", name
        reads_blocks = name in ("prefill", "decode")
        assert ("kv-mac-key" in svc["secrets"]) == reads_blocks, name
        assert (env.get("PDSERVE_KV_MAC_KEY_FILE") == "/run/secrets/kv-mac-key") == reads_blocks, name
        # Standalone services bind loopback; in a container that would be unreachable: say 0.0.0.0.
        assert build_parser().parse_args(svc["command"]).bind.startswith("0.0.0.0:"), name
        assert env["PDSERVE_METRICS_HOST"] == "0.0.0.0" and "9100" not in str(svc.get("ports", [])), name
