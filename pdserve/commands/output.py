"""Where the benchmark commands put their JSON: a file, or stdout for `--json -`."""

from __future__ import annotations

import json
from typing import Any


def write_json(path: str, data: Any) -> None:
    text = json.dumps(data, indent=2)
    if path == "-":
        print(text)
        return
    with open(path, "w") as f:
        f.write(text + "\n")
