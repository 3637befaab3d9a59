"""A/B experiment end to end: two deployments of stories260K (FP32 and an INT8 copy made by
`pdserve quantize`) behind one experiment, started by `pdserve up --config` as real processes.

Checks: requests are split between the arms and sticky per session; each arm's greedy output is
that deployment's in-process reference; the Feedback rpc and POST /v1/feedback change the arm's
reward; the report command prints both arms; killing the INT8 deployment's decode worker moves
its sessions and all new traffic to FP32 with no failed request once the gateway has noticed.
"""

from __future__ import annotations

import json
import time
import tomllib
import urllib.error
import urllib.request

import grpc
import pytest

from conftest import STORIES_GGUF
from pdserve.cli import build_parser
from pdserve.ports import free_port
from pdserve.runtime.config import CacheConfig, EngineConfig
from pdserve.runtime.engine import Engine
from pdserve.runtime.block_hash import prompt_block_hashes
from pdserve.runtime.loader import inspect_checkpoint, load_checkpoint
from pdserve.runtime.sampling_params import SamplingParams
from pdserve.stack import start_stack
from pdserve.v1 import common_pb2, gateway_pb2

PROMPTS = ["Once upon a time", "The little dog", "Lily went to the park", "Tom had a red ball",
           "One day, a bird", "The sun was"]
MAX_TOKENS = 12
EXPERIMENT = "stories"
ARMS = ("stories-fp32", "stories-int8")

CONFIG = """
[deployments.stories-fp32]
model = "{fp32}"
num_blocks = 128

[deployments.stories-int8]
model = "{int8}"
num_blocks = 128

[experiments.stories]
arms = ["stories-fp32", "stories-int8"]
policy = "fixed"

[experiments.stories.params]
weights = {{ "stories-fp32" = 0.5, "stories-int8" = 0.5 }}

[experiments.stories.reward]
ttft_ms = 600000   # met by every request here: the rewards below depend on feedback only
tpot_ms = 600000
w_feedback = 1.0
"""


def greedy_reference(path) -> dict[str, list[int]]:
    ck = load_checkpoint(path)
    engine = Engine.from_checkpoint(ck, EngineConfig(cache=CacheConfig(num_blocks=64)))
    seqs = engine.generate([ck.tokenizer.encode(p) for p in PROMPTS],
                           SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
    return {p: s.output_ids for p, s in zip(PROMPTS, seqs)}


@pytest.fixture(scope="module")
def int8_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("ab") / "int8"
    args = build_parser().parse_args(["quantize", "--model", str(STORIES_GGUF), "--out", str(out),
                                      "--method", "rtn", "--bits", "8"])
    assert args._run(args) == 0
    return out


@pytest.fixture(scope="module")
def setup(int8_dir):
    config = int8_dir.parent / "ab.toml"
    config.write_text(CONFIG.format(fp32=STORIES_GGUF, int8=int8_dir))
    references = {"stories-fp32": greedy_reference(STORIES_GGUF), "stories-int8": greedy_reference(int8_dir)}
    http_port = free_port()
    stack = start_stack(1, 1, "--config", str(config), "--http-port", str(http_port), "--experiment-seed", "0")
    try:
        yield stack, references, f"http://127.0.0.1:{http_port}"
    finally:
        stack.stop()


def test_kv_blocks_of_the_two_formats_never_share_a_hash(int8_dir):
    """The KV namespace of a deployment: block hashes include the model fingerprint (over the
    weight files, so the INT8 copy differs) and the KV dtype, so even one shared kvstore could not
    hand one deployment's blocks to the other."""
    fp32, int8 = inspect_checkpoint(STORIES_GGUF), inspect_checkpoint(int8_dir)
    assert fp32.fingerprint != int8.fingerprint
    tokens = fp32.tokenizer.encode("Once upon a time there was a little girl named Lily. " * 4)
    assert tokens == int8.tokenizer.encode("Once upon a time there was a little girl named Lily. " * 4)
    hashes = {(ck.fingerprint, dtype): prompt_block_hashes(tokens, 16, ck.fingerprint, dtype)
              for ck in (fp32, int8) for dtype in ("float32", "float16")}
    assert all(len(h) >= 2 for h in hashes.values())
    all_hashes = [h for chain in hashes.values() for h in chain]
    assert len(set(all_hashes)) == len(all_hashes)  # no block of one (model, dtype) names another's


def test_the_example_config_is_valid(int8_dir):
    """deploy/experiments.toml, with its INT8 arm pointed at a freshly quantized copy."""
    from conftest import REPO
    from gateway.experiments.serve_config import parse_serve_config

    data = tomllib.loads((REPO / "deploy" / "experiments.toml").read_text())
    data["deployments"]["stories-int8"]["model"] = str(int8_dir)
    config = parse_serve_config(data, REPO / "deploy")
    assert config.deployments["stories-fp32"].model == str(STORIES_GGUF.resolve())
    assert config.experiments["stories"].build_policy().name == "thompson"


def generate(stub, prompt: str, session: str = "", model: str = EXPERIMENT) -> tuple[str, str, list[int]]:
    """(request id, deployment, tokens) of one greedy Generate."""
    params = common_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    chunks = list(stub.Generate(gateway_pb2.GenerateRequest(prompt=prompt, sampling=params, session_id=session,
                                                            model=model), timeout=60))
    assert len({c.deployment for c in chunks}) == 1
    return chunks[0].request_id, chunks[0].deployment, [t for c in chunks for t in c.token_ids]


def report(stub) -> dict[str, gateway_pb2.ArmReport]:
    return {a.arm: a for a in stub.ExperimentReport(gateway_pb2.ExperimentReportRequest(), timeout=10).arms}


def http(method: str, url: str, body: dict | None = None) -> tuple[int, dict, dict]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), json.loads(err.read())


def test_split_sticky_and_each_arm_matches_its_reference(setup):
    stack, references, _ = setup
    stub = stack.gateway_stub()
    first: dict[str, str] = {}
    for i in range(12):
        prompt = PROMPTS[i % len(PROMPTS)]
        _, deployment, tokens = generate(stub, prompt, session=f"s{i}")
        assert tokens == references[deployment][prompt], (deployment, prompt)
        first[f"s{i}"] = deployment
    assert set(first.values()) == set(ARMS)  # a 50/50 split over 12 sessions (seeded) uses both
    for session, deployment in first.items():  # every later request of a session: the same arm
        assert generate(stub, PROMPTS[0], session=session)[1] == deployment
    # a deployment can also be asked for by its own name, bypassing the experiment
    assert generate(stub, PROMPTS[1], model="stories-int8")[1:] == ("stories-int8",
                                                                    references["stories-int8"][PROMPTS[1]])
    rows = report(stub)
    assert sum(rows[a].requests for a in ARMS) == 24 and all(rows[a].rewarded == rows[a].requests for a in ARMS)
    assert all(rows[a].reward_mean == 1.0 and rows[a].up and rows[a].errors == 0 for a in ARMS)


def test_feedback_by_rpc_and_http_changes_the_reward(setup):
    stack, _, base = setup
    stub = stack.gateway_stub()
    rid, arm, _ = generate(stub, PROMPTS[2], session="feedback-rpc")
    before = report(stub)[arm]
    reply = stub.Feedback(gateway_pb2.FeedbackRequest(request_id=rid, score=0.0, comment="dull"), timeout=10)
    assert (reply.experiment, reply.arm, reply.reward, reply.pending) == (EXPERIMENT, arm, 0.75, False)  # ttft, tpot, success 1; feedback 0
    after = report(stub)[arm]
    assert after.feedback == before.feedback + 1
    assert after.reward_mean == pytest.approx(before.reward_mean - 0.25 / after.rewarded)

    status, headers, body = http("POST", base + "/v1/chat/completions", {
        "model": EXPERIMENT, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "user": "u-http"})
    assert status == 200 and body["model"] == EXPERIMENT
    arm = headers["X-Pdserve-Deployment"]
    before = report(stub)[arm]
    status, _, body = http("POST", base + "/v1/feedback", {"request_id": headers["X-Request-Id"], "score": 0.5})
    assert status == 200 and (body["arm"], body["reward"]) == (arm, pytest.approx(0.875))
    assert report(stub)[arm].reward_mean == pytest.approx(before.reward_mean - 0.125 / before.rewarded)

    assert http("POST", base + "/v1/feedback", {"request_id": "nope", "score": 1})[0] == 404
    status, _, body = http("POST", base + "/v1/feedback", {"request_id": headers["X-Request-Id"]})
    assert status == 400 and body["error"]["param"] == "score"
    status, _, body = http("POST", base + "/v1/feedback", {"request_id": headers["X-Request-Id"], "score": 7})
    assert status == 400 and "outside this experiment's feedback range" in body["error"]["message"]
    with pytest.raises(grpc.RpcError) as missing:
        stub.Feedback(gateway_pb2.FeedbackRequest(request_id="nope", score=1.0), timeout=10)
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND


def test_models_list_and_unknown_model(setup):
    stack, _, base = setup
    status, _, body = http("GET", base + "/v1/models")
    assert status == 200 and [m["id"] for m in body["data"]] == [EXPERIMENT, *ARMS]
    assert body["data"][0]["pdserve_experiment"]["arms"] == list(ARMS)
    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        metrics = r.read().decode()
    for arm in ARMS:  # per-arm metrics beside the gateway-wide ones
        for name in ("pdserve_experiment_requests_total", "pdserve_experiment_reward",
                     "pdserve_experiment_allocation", "pdserve_experiment_ttft_seconds_count"):
            assert f'{name}{{arm="{arm}",experiment="{EXPERIMENT}"}}' in metrics, (name, arm)
    assert "pdserve_requests_total" in metrics
    status, _, body = http("POST", base + "/v1/completions", {"model": "gpt-4", "prompt": "Hi"})
    assert status == 404 and "'stories', 'stories-fp32', 'stories-int8'" in body["error"]["message"]
    with pytest.raises(grpc.RpcError) as unknown:
        generate(stack.gateway_stub(), "Hi", model="gpt-4")
    assert unknown.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "stories-int8" in unknown.value.details()


def test_report_command_prints_both_arms(setup, capsys):
    stack, _, _ = setup
    args = build_parser().parse_args(["experiment", "report", "--gateway", stack.gateway_address, "--json", "-"])
    assert args._run(args) == 0
    rows = json.loads(capsys.readouterr().out)["arms"]
    assert [r["arm"] for r in rows] == list(ARMS) and all(r["requests"] > 0 for r in rows)
    args = build_parser().parse_args(["experiment", "report", "--gateway", stack.gateway_address])
    assert args._run(args) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:3] == ["experiment", "arm", "requests"]
    assert [line.split()[1] for line in table[1:]] == list(ARMS)


def test_a_deployment_going_down_moves_its_traffic(setup):
    stack, references, _ = setup
    stub = stack.gateway_stub()
    on_int8 = [s for s in (f"down{i}" for i in range(10)) if generate(stub, PROMPTS[0], session=s)[1] == ARMS[1]]
    assert on_int8
    stack.kill("decode-stories-int8-0")
    deadline = time.monotonic() + 20
    while report(stub)[ARMS[1]].up:  # the gateway notices through its health probes
        assert time.monotonic() < deadline, "the gateway did not notice the dead decode worker"
        time.sleep(0.2)
    assert report(stub)[ARMS[1]].allocation == 0.0
    for session in [*on_int8, "new-a", "new-b", ""]:
        _, deployment, tokens = generate(stub, PROMPTS[3], session=session)
        assert deployment == ARMS[0] and tokens == references[ARMS[0]][PROMPTS[3]]
