"""`pdserve scale`: change the number of workers of a running `pdserve up`.

    pdserve scale --decode 3 [--prefill 2]      # prints: prefill=[...] decode=[...]
    pdserve scale                               # prints the membership, changes nothing

It finds `up` by its control socket (pdserve.control): in --run-dir, else in the run directory of
the `up` whose gateway listens on --grpc-port. `up` starts new workers, waits for them to serve and
adds them to the gateway's list; removed workers leave the list first and are then stopped
(pdserve.scaler). Exit 0 with the new membership on stdout; 2 for a count that is not allowed
(below 1, over up's --max-workers); 1 when no `up` answers or it could not do it; the reason is one
line on stderr.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

NAME = "scale"
HELP = "add or remove prefill and decode workers of a running `pdserve up`"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from gateway.config import DEFAULT_BIND

    p.add_argument("--decode", type=int, default=None, metavar="N", help="decode workers wanted")
    p.add_argument("--prefill", type=int, default=None, metavar="N", help="prefill workers wanted")
    p.add_argument("--grpc-port", type=int, default=int(DEFAULT_BIND.rsplit(":", 1)[1]),
                   help="the --grpc-port of the `up` to talk to (default: %(default)s)")
    p.add_argument("--run-dir", default=None, metavar="DIR", help="the --run-dir of that `up`, if it was given one")
    p.add_argument("--timeout", type=float, default=600.0, metavar="S",
                   help="seconds to wait for up to finish (new workers load the model first)")


def run(args: argparse.Namespace) -> int:
    from pdserve import control

    wanted = {kind: n for kind in ("prefill", "decode") if (n := getattr(args, kind)) is not None}
    bad = next((f"--{kind} {n}" for kind, n in wanted.items() if n < 1), None)
    if bad:
        print(f"pdserve scale: {bad}: need at least 1 worker", file=sys.stderr)
        return 2
    directory = Path(args.run_dir).resolve() if args.run_dir else control.run_dir(args.grpc_port)
    try:
        answer = control.call(directory, {"scale": wanted} if wanted else {}, timeout_s=args.timeout)
    except control.ControlError as err:
        print(f"pdserve scale: {err}", file=sys.stderr)
        return 1
    if not answer.get("ok"):
        print(f"pdserve scale: {answer.get('error') or 'refused'}", file=sys.stderr)
        return 2 if answer.get("usage") else 1
    print(" ".join(f"{kind}=[{','.join(answer.get(kind, []))}]" for kind in ("prefill", "decode")))
    return 0
