"""Security pieces in isolation: the token bucket (injected clock), per-key limits, API key files and
the key ring, TLS settings, the internal token on a real in-process server, log redaction, and an
audit that nothing deserializes with pickle/eval from the wire."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import grpc
import pytest

from gateway.auth import AuthError, KeyRing, bearer_token, digest, parse_keys
from gateway.key_limits import KeyLimiter, KeyLimitExceeded, KeyLimits, TokenBucket, parse_rate
from kvstore.client import KVStoreClient
from kvstore.server import serve
from pdserve import internal_auth, log_privacy
from pdserve.grpc_server import ProcessConfig, stop_server
from pdserve.healthcheck import check
from pdserve.tls import TlsConfig, TlsConfigError
from security_certs import make_pki

REPO = Path(__file__).resolve().parents[1]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_token_bucket_refills_at_its_rate_up_to_its_size():
    clock = Clock()
    bucket = TokenBucket(rate_per_s=2.0, size=3, clock=clock)
    assert [bucket.take() for _ in range(3)] == [0.0, 0.0, 0.0]  # a full bucket: the burst
    assert bucket.take() == pytest.approx(0.5)  # empty: one token in 1/rate seconds
    clock.now += 0.25
    assert bucket.take() == pytest.approx(0.25)  # half a token so far; a refusal takes nothing
    clock.now += 0.25
    assert bucket.take() == 0.0
    clock.now += 100  # a long pause refills only up to the size
    assert [bucket.take() for _ in range(4)][-1] > 0


def test_key_limiter_concurrency_and_rate():
    clock = Clock()
    limiter = KeyLimiter("team", KeyLimits(rate_per_s=1.0, burst=2, concurrency=1), clock)
    with limiter.admit():
        with pytest.raises(KeyLimitExceeded, match="'team' already has 1 requests in flight"):
            limiter.acquire()
    assert limiter.in_flight == 0
    with limiter.admit():
        pass
    with pytest.raises(KeyLimitExceeded, match="rate limit of 1 requests/s") as info:
        limiter.acquire()
    assert info.value.retry_after_s == pytest.approx(1.0)
    clock.now += 1
    limiter.acquire()
    assert limiter.in_flight == 1


def test_key_limits_parse():
    assert KeyLimits.parse([]) == KeyLimits()
    limits = KeyLimits.parse(["rate=120/m", "concurrency=4"])
    assert limits.rate_per_s == 2.0 and limits.bucket_size == 2 and limits.concurrency == 4
    assert KeyLimits.parse(["rate=0.5", "burst=10"]).bucket_size == 10
    assert parse_rate("3600/h") == 1.0
    for bad in (["rate=5/day"], ["burst=x"], ["colour=red"], ["rate=1", "rate=2"], ["concurrency=0"], ["rate=-1"]):
        with pytest.raises(ValueError):
            KeyLimits.parse(bad)


def test_keys_file_parse_and_errors_never_echo_keys():
    keys = parse_keys("# comment\n\nsk-aaa name=alice rate=5/s burst=10 concurrency=4  # trailing\nsk-bbb\n")
    assert [k.name for k in keys] == ["alice", f"key-{digest('sk-bbb').hex()[:8]}"]
    assert keys[0].limits == KeyLimits(5.0, 10, 4) and keys[0].digest == digest("sk-aaa")
    for text, match in [("sk-aaa rate=fast", "line 1"), ("sk-a\nsk-a", "line 2.*twice"),
                        ("sk-a name=x\nsk-b name=x", "twice"), ("# none\n", "no API key"),
                        ("rate=5/s sk-a", "start with the key")]:
        with pytest.raises(ValueError, match=match) as info:
            parse_keys(text)
        assert "sk-" not in str(info.value).replace("sk-a name", "")


def test_key_ring_authenticates_bearer_keys():
    ring = KeyRing(parse_keys("sk-one name=one\nsk-two name=two concurrency=1"))
    assert ring.authenticate("Bearer sk-two").name == "two"
    assert ring.authenticate("bearer   sk-one ").name == "one"
    for bad in (None, "", "sk-one", "Basic sk-one", "Bearer ", "Bearer sk-three"):
        with pytest.raises(AuthError):
            ring.authenticate(bad)
    assert bearer_token("Bearer abc") == "abc"
    assert all(not hasattr(k, "key") for k in ring._keys)  # only digests are kept


def test_key_ring_from_file(tmp_path):
    path = tmp_path / "keys"
    path.write_text("sk-x\n")
    assert len(KeyRing.from_file(path)) == 1
    with pytest.raises(ValueError, match="cannot read the API keys file"):
        KeyRing.from_file(tmp_path / "missing")


def test_tls_config_from_env_and_errors(tmp_path):
    pki = make_pki(tmp_path)
    assert not TlsConfig.from_env({}).serves_tls and not TlsConfig.from_env({}).dials_tls
    env = {"PDSERVE_TLS_CERT": str(pki.cert), "PDSERVE_TLS_KEY": str(pki.key), "PDSERVE_TLS_CA": str(pki.ca),
           "PDSERVE_TLS_CLIENT_AUTH": "1", "PDSERVE_TLS_SERVER_NAME": "localhost"}
    config = TlsConfig.from_env(env)
    assert config.client_auth and config.serves_tls and config.env() == env
    assert config.channel_options() == [("grpc.ssl_target_name_override", "localhost")]
    assert TlsConfig.from_env({"PDSERVE_TLS_CA": str(pki.ca)}).dials_tls  # a client needs only the CA
    for bad, match in [({"PDSERVE_TLS_CERT": str(pki.cert)}, "go together"),
                       ({"PDSERVE_TLS_CA": str(pki.ca), "PDSERVE_TLS_CLIENT_AUTH": "1"}, "CLIENT_AUTH=1 needs"),
                       ({"PDSERVE_TLS_CA": str(tmp_path / "nope.pem")}, "no such file")]:
        with pytest.raises(TlsConfigError, match=match):
            TlsConfig.from_env(bad)


async def _kvstore_with_token_and_mtls(pki, env: dict[str, str], monkeypatch) -> None:
    # The server gets its config as a main would build it; KVStoreClient (which takes no config
    # yet) dials as the process environment says, the same environment here.
    process = ProcessConfig.from_env(env)
    assert process.tls.client_auth and process.internal_token == "s3cret"
    server, port = await serve("127.0.0.1:0", 1 << 20, process=process)
    address = f"127.0.0.1:{port}"
    try:
        async with KVStoreClient(address) as client:  # grpc_channel: TLS, client cert and token
            assert await client.lookup([b"h" * 32]) == 0
        assert await asyncio.to_thread(check, address) == "SERVING"
        monkeypatch.delenv(internal_auth.TOKEN_ENV)  # a caller without the token
        async with KVStoreClient(address) as client:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await client.lookup([b"h" * 32])
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # A client without a certificate is refused by the handshake; health over TLS stays open.
        no_cert = TlsConfig(ca=str(pki.ca))
        assert (await asyncio.to_thread(check, address, "", 2.0, no_cert)).startswith("UNREACHABLE")
        assert (await asyncio.to_thread(check, address, "", 2.0, TlsConfig())).startswith("UNREACHABLE")
    finally:
        await stop_server(server, 0)


def test_in_process_server_with_mtls_and_internal_token(tmp_path, monkeypatch):
    pki = make_pki(tmp_path)
    env = {**TlsConfig(str(pki.cert), str(pki.key), str(pki.ca), client_auth=True).env(),
           internal_auth.TOKEN_ENV: "s3cret"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    asyncio.run(_kvstore_with_token_and_mtls(pki, env, monkeypatch))


def test_internal_token_from_file(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("from-file\n")
    assert internal_auth.token_from_env({internal_auth.TOKEN_FILE_ENV: str(token_file)}) == "from-file"
    both = {internal_auth.TOKEN_FILE_ENV: str(token_file), internal_auth.TOKEN_ENV: "from-env"}
    assert internal_auth.token_from_env(both) == "from-env"
    assert ProcessConfig.from_env(both).internal_token == "from-env"  # what a main builds
    with pytest.raises(ValueError, match="PDSERVE_INTERNAL_TOKEN_FILE="):
        ProcessConfig.from_env({internal_auth.TOKEN_FILE_ENV: str(tmp_path / "missing")})


def test_log_privacy():
    from gateway.config import GatewayConfig

    assert log_privacy.content("my secret prompt") == "<16 chars hidden; PDSERVE_LOG_PROMPTS=1 shows them>"
    assert log_privacy.content("my secret prompt", shown=True) == "my secret prompt"
    # The gateway's setting: hidden unless --log-prompts or PDSERVE_LOG_PROMPTS=1 asks.
    assert not GatewayConfig().log_prompts
    assert GatewayConfig.from_args(None, {log_privacy.LOG_PROMPTS_ENV: "1"}).log_prompts
    assert not GatewayConfig.from_args(None, {log_privacy.LOG_PROMPTS_ENV: "0"}).log_prompts
    assert log_privacy.url("redis://:pw@redis:6379/0") == "redis://:***@redis:6379/0"
    assert log_privacy.url("rediss://user:pw@[::1]:6380/1") == "rediss://user:***@[::1]:6380/1"
    assert log_privacy.url("redis://redis:6379/0") == "redis://redis:6379/0"


# Calls that turn bytes into code or objects. The serving packages receive bytes from the network
# (protobuf, JSON, KV blocks with a fixed binary header) and must never hand them to any of these.
UNSAFE = re.compile(r"\bpickle\b|\bmarshal\.loads|\bshelve\b|(?<![.\w])eval\(|(?<![.\w])exec\(|yaml\.load\(|"
                    r"allow_pickle=True|torch\.load\((?![^)]*weights_only=True)")


def test_no_unsafe_deserialization_in_serving_code():
    offenders = []
    for package in ("gateway", "prefill", "decode", "kvstore", "pdserve"):
        for path in (REPO / package).rglob("*.py"):
            if "v1" in path.relative_to(REPO).parts:
                continue  # generated protobuf stubs
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if UNSAFE.search(line.split("#", 1)[0]):
                    offenders.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)
    assert UNSAFE.search("data = pickle.loads(blob)") and UNSAFE.search("torch.load(f)")
    assert not UNSAFE.search("torch.load(f, weights_only=True)") and not UNSAFE.search("model.eval()")
