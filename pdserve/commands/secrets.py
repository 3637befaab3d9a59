"""`pdserve secrets DIR`: create the cluster secrets compose.yaml mounts (docs/security.md).

Writes `internal-token` (PDSERVE_INTERNAL_TOKEN_FILE of every service) and `kv-mac-key`
(PDSERVE_KV_MAC_KEY_FILE of the prefill and decode workers) into DIR, each a fresh random value,
mode 0600 unless --mode says otherwise: the containers run as user `pdserve`, and compose without
swarm mounts a file secret with its host owner and mode, so a host user other than the
container's needs `--mode 644` (or a chown to the container's uid). An existing file is kept:
rotating a secret is deleting its file and restarting every service at once. Prints the paths,
never the values.
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
from pathlib import Path

NAME = "secrets"
HELP = "create the internal token and KV MAC key files compose.yaml mounts (kept when present)"
FILES = ("internal-token", "kv-mac-key")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", nargs="?", default="deploy/secrets",
                   help="directory to write them in (default: deploy/secrets, compose's PDSERVE_SECRETS_DIR)")
    p.add_argument("--mode", type=_octal_mode, default=0o600,
                   help="octal file mode of new files (default 600; 644 when the containers' user must read them)")


def _octal_mode(value: str) -> int:
    try:
        mode = int(value, 8)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not an octal file mode such as 600 or 644") from None
    if not 0 <= mode <= 0o777:
        raise argparse.ArgumentTypeError(f"{value!r} is not a file mode (at most 777)")
    return mode


def write_secret(path: Path, mode: int = 0o600) -> bool:
    """Create `path` holding a fresh 256-bit secret with `mode`; False when it exists already."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # never readable before chmod
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
    path.chmod(mode)
    return True


def run(args: argparse.Namespace) -> int:
    directory = Path(args.dir)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        for name in FILES:
            made = write_secret(directory / name, args.mode)
            print(f"{directory / name}: {'created' if made else 'exists, kept'}")
    except OSError as err:
        print(f"pdserve secrets: {directory}: {err.strerror or err}", file=sys.stderr)
        return 1
    return 0
