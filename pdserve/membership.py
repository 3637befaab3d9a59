"""The gateway's membership as files: `pdserve up` points the gateway at one list file per worker
kind (`--prefill file:///RUN/prefill.targets`, gateway.target_file) and rewrites it as workers come
and go (pdserve.scaler); and the spec of one more worker, made like the ones `up` planned.

Files are replaced atomically (a temporary file in the same directory, renamed over the old one):
the gateway, polling on its own cadence, reads either the old list or the new one, never half.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path

from pdserve.ports import free_port
from pdserve.supervisor import ChildSpec

KINDS = ("prefill", "decode")
METRICS_ENV = "PDSERVE_METRICS_PORT"


def list_file(run_dir: Path, kind: str) -> Path:
    """Where the gateway of `up` reads its `kind` workers."""
    return run_dir / f"{kind}.targets"


def write_list_file(path: Path, addresses: Iterable[str]) -> None:
    """Replace `path` atomically by one address a line."""
    text = "".join(f"{address}\n" for address in addresses)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def gateway_on_list_files(gateway: ChildSpec, run_dir: Path) -> ChildSpec:
    """The gateway's command with its --prefill and --decode values replaced by the list files."""
    command = list(gateway.command)
    for kind in KINDS:
        i = command.index(f"--{kind}")
        command[i + 1] = f"file://{list_file(run_dir, kind).resolve()}"
    return replace(gateway, command=tuple(command))


def worker_like(template: ChildSpec, name: str, host: str = "127.0.0.1") -> ChildSpec:
    """One more worker of `template`'s kind: its command and environment on a free port of `host`
    (and a free metrics port when the template serves /metrics)."""
    address = f"{host}:{free_port(host)}"
    command = list(template.command)
    command[command.index("--bind") + 1] = address
    env = tuple((k, str(free_port()) if k == METRICS_ENV else v) for k, v in template.env)
    return ChildSpec(name, address, tuple(command), env)
