"""The `pdserve` command: one subcommand per module in `pdserve.commands`.

Each command module has `NAME`, `HELP`, `add_arguments(parser)` and `run(args) -> int`.

Options are never abbreviated (`--api-key` is not read as `--api-keys-file`), and a usage error
never echoes a value that may be a secret: a mistyped `--api-key sk-...` must not print the key
to a terminal or a CI log.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
from typing import NoReturn

COMMAND_MODULES = (
    "generate",
    "bench_engine",
    "bench_stack",
    "step_log",
    "up",
    "scale",
    "gateway",
    "prefill",
    "decode",
    "kvstore",
    "quantize",
    "quant_eval",
    "qat",
    "bench_kv",
    "bench",
    "bench_overload",
    "bench_disagg",
    "soak",
    "secrets",
    "experiment",
)


_UNRECOGNIZED = "unrecognized arguments: "
_QUOTED = re.compile(r"'([^']*)'")
# A long unbroken run of key-ish characters with letters and digits, or an OpenAI-style "sk-..." key.
_SECRET_LIKE = re.compile(r"(?=.*[A-Za-z])(?=.*\d)[A-Za-z0-9_\-+=.:]{16,}|sk-\S*")


def redact_usage_error(message: str) -> str:
    """`message` of an argparse error with every value that may be a secret hidden: unrecognized
    arguments are reduced to their option names; quoted values that look like keys are masked."""
    if message.startswith(_UNRECOGNIZED):
        words = message[len(_UNRECOGNIZED):].split()
        options = [w.split("=", 1)[0] for w in words if w.startswith("-")]
        hidden = len(words) - len(options) + sum("=" in w for w in words if w.startswith("-"))
        note = f" ({hidden} value{'s' * (hidden != 1)} not shown)" if hidden else ""
        return _UNRECOGNIZED + (" ".join(options) or "(values)") + note
    return _QUOTED.sub(lambda m: "'<hidden>'" if _SECRET_LIKE.fullmatch(m.group(1)) else m.group(0), message)


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """--help shows each option's default: the flags derived from config fields say theirs already
    (pdserve.config_flags), the others get " (default: X)" here (not for None or a suppressed one)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (not action.option_strings or action.default in (None, argparse.SUPPRESS) or "%(default)" in text
                or "default: " in text):
            return action.help
        return f"{text} (default: %(default)s)"


class SafeArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors pass through `redact_usage_error`, that never takes an
    abbreviation for an option, and whose --help shows defaults. Subcommand parsers (nested ones
    too) are made with the class of their parent: they are all SafeArgumentParsers."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs["allow_abbrev"] = False  # whatever a caller asks: an abbreviation can swallow a secret
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):  # type: ignore[override]
        super().error(redact_usage_error(message))


def build_parser() -> argparse.ArgumentParser:
    parser = SafeArgumentParser(prog="pdserve", description="Disaggregated LLM serving.")
    # parser_class is inherited by every subcommand's parser: they redact too.
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


# Long-running services: once one has stopped gracefully there is nothing left to do but exit.
SERVICES = frozenset({"gateway", "prefill", "decode", "kvstore"})


def main(argv: list[str] | None = None) -> int:
    from pdserve import parent_watch

    parent_watch.arm()  # a child of `pdserve up` exits when `up` dies (pdserve/parent_watch.py)
    args = build_parser().parse_args(argv)
    try:
        code = args._run(args)
        if argv is None and args.command in SERVICES:  # a service process, not a call from Python
            exit_now(code)
        return code
    except Exception as err:
        # A model that cannot load, or flags that cannot work together (a ConfigError): one line
        # saying why, no traceback. Their modules are in sys.modules whenever they raised; light
        # commands never import them (nor torch).
        loader, config = sys.modules.get("pdserve.runtime.loader"), sys.modules.get("pdserve.runtime.config")
        if not ((loader and isinstance(err, loader.ModelLoadError)) or (config and isinstance(err, config.ConfigError))):
            raise
        print(f"pdserve: {err}", file=sys.stderr)
        return 2


def exit_now(code: int | None) -> NoReturn:
    """End a service process that has stopped gracefully without the interpreter's teardown: it
    spends 1.4 to 2.4 s finalising modules (mostly torch's) after every stop (strace shows every
    child reaching atexit within 50 ms of SIGTERM), which each `pdserve up` shutdown, scale-in
    and test stack waits for. What teardown would still do is done first: spans flushed (the
    OTLP exporter batches them), logs and stdio flushed. The services' threads are daemons with
    nothing durable left (the engine thread, the grammar and tokenizer pools)."""
    import logging

    from opentelemetry import trace

    provider = trace.get_tracer_provider()
    if hasattr(provider, "shutdown"):  # the SDK's provider (tracing on); the default proxy has none
        provider.shutdown()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


if __name__ == "__main__":
    sys.exit(main())
