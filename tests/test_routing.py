"""KV-aware routing: the decode cost function and the pick it drives (pure functions)."""

from __future__ import annotations

from gateway.router import DEFAULT_WEIGHTS, DecodeCandidate, RoutingWeights, decode_cost, pick_decode


def _c(name: str, inflight: int = 0, *, resident: int = 0, free: int = 100, total: int = 100,
       running: int = 0, home: bool = False, healthy: bool = True) -> DecodeCandidate:
    return DecodeCandidate(name, healthy, inflight, running, free, total, resident, home)


def test_cost_terms_follow_the_documented_weights() -> None:
    w = DEFAULT_WEIGHTS
    assert decode_cost(_c("a", 3), 4) == 3 * w.load
    assert decode_cost(_c("a", 1, running=5), 4) == 5 * w.load  # the worker's own batch counts
    assert decode_cost(_c("a", free=25), 4) == w.kv_pressure * 0.75
    assert decode_cost(_c("a", resident=32), 40) == -32 * w.prefix_block
    assert decode_cost(_c("a", home=True), 4) == -w.session
    assert decode_cost(_c("a", free=3), 10) >= w.no_room  # cannot hold the request at all
    assert decode_cost(_c("a", free=3, resident=8), 10) < w.no_room  # ... unless its prefix is there
    assert decode_cost(_c("a", 2, total=0, free=0), 10) == 2 * w.load  # unknown KV: load only


def test_resident_prefix_beats_a_little_load() -> None:
    cands = [_c("idle"), _c("warm", 1, resident=32)]  # 32 blocks = 2 requests' worth of credit
    assert pick_decode(cands, 40, cursor=0) == 1
    cands = [_c("idle"), _c("busy", 4, resident=32)]
    assert pick_decode(cands, 40, cursor=0) == 0


def test_session_stays_while_cheap_then_moves() -> None:
    assert pick_decode([_c("home", 1, home=True), _c("other")], 4, cursor=1) == 0
    assert pick_decode([_c("home", 3, home=True), _c("other")], 4, cursor=0) == 1


def test_unhealthy_and_full_workers_are_avoided() -> None:
    assert pick_decode([_c("down", healthy=False, resident=50), _c("up", 5)], 4, cursor=0) == 1
    assert pick_decode([_c("full", free=1), _c("busy", 3)], 20, cursor=0) == 1
    assert pick_decode([_c("down", healthy=False)], 4, cursor=0) is None


def test_ties_go_round_robin() -> None:
    cands = [_c("a"), _c("b"), _c("c")]
    assert [pick_decode(cands, 4, cursor=i) for i in range(4)] == [0, 1, 2, 0]


def test_weights_are_tunable() -> None:
    no_prefix = RoutingWeights(prefix_block=0.0)
    cands = [_c("idle"), _c("warm", 1, resident=64)]
    assert pick_decode(cands, 70, cursor=0) == 1
    assert pick_decode(cands, 70, cursor=0, weights=no_prefix) == 0
