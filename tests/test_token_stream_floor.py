"""benchmarks/token_stream_floor.py: both layouts of its first hop carry every token of every stream
(the multiplexed relay hands each stream's token to its own client stream) and it counts CPU in all
three processes."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import token_stream_floor  # noqa: E402


def test_both_layouts_deliver_every_token_and_count_each_process() -> None:
    args = token_stream_floor.parse_args(["--streams", "3", "--tokens", "7", "--step-ms", "1"])
    for method in ("PerStream", "Multiplexed"):
        row = token_stream_floor.measure(args, method)
        assert row["tokens"] == 3 * 7, row
        assert set(row["cpu_us_per_token"]) == {"source", "relay", "client"}
        assert row["total_us_per_token"] == round(sum(row["cpu_us_per_token"].values()), 1)
