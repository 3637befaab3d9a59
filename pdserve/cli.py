"""The `pdserve` command: one subcommand per module in `pdserve.commands`.

Each command module has `NAME`, `HELP`, `add_arguments(parser)` and `run(args) -> int`.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMAND_MODULES = (
    "generate",
    "bench_engine",
    "bench_stack",
    "up",
    "gateway",
    "prefill",
    "decode",
    "kvstore",
    "quantize",
    "quant_eval",
    "bench_kv",
    "bench",
    "bench_overload",
    "bench_disagg",
    "soak",
    "experiment",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated LLM serving.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module_name in COMMAND_MODULES:
        try:
            module = importlib.import_module(f"pdserve.commands.{module_name}")
        except ModuleNotFoundError as err:
            if err.name != f"pdserve.commands.{module_name}":
                raise
            continue  # a command that is not built yet
        p = sub.add_parser(module.NAME, help=module.HELP, description=module.HELP)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args._run(args)


if __name__ == "__main__":
    sys.exit(main())
