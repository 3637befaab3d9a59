"""The `pdserve` command line as people know it from other servers (issue 19, item 5): no parser takes an
abbreviation for an option, no usage or config error echoes a secret, --help shows defaults, and
`pdserve gateway` / `pdserve up` take --host/--port, --served-model-name, --api-key, --allowed-origins and
--max-model-len (one over the model's window is one line, before anything starts). What the flags do
to a running stack is in tests/test_http_surface.py."""

from __future__ import annotations

import argparse
from pathlib import Path

import gguf
import pytest

from conftest import STORIES_GGUF
from gateway.config import GatewayConfig
from gateway.server import http_bind_of
from pdserve.cli import build_parser
from pdserve.commands.up import plan

SECRET = "sk-live-7c1f0a9e3b5d42e8a6f1"
STORIES = Path(__file__).resolve().parent / "fixtures" / "stories260K" / "stories260K.gguf"


def parsers(parser: argparse.ArgumentParser):
    """`parser` and every parser below it (subcommands, their subcommands, ...)."""
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from parsers(sub)


def usage_error(capsys: pytest.CaptureFixture, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(argv)
    assert exit_.value.code == 2
    return capsys.readouterr().err


def gateway_config(argv: list[str], env: dict[str, str] | None = None) -> GatewayConfig:
    return GatewayConfig.from_args(build_parser().parse_args(["gateway", *argv]), env or {})


def context_length(path: Path) -> int:
    """The model's window as the GGUF file itself says it (gguf's own reader, not pdserve's loader)."""
    reader = gguf.GGUFReader(path)
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    return int(reader.fields[f"{arch}.context_length"].parts[-1][0])


# ---- abbreviations and secrets -------------------------------------------------------------------

def test_no_parser_takes_an_abbreviation() -> None:
    found = list(parsers(build_parser()))
    assert len(found) > 15 and all(p.allow_abbrev is False for p in found), \
        [p.prog for p in found if p.allow_abbrev]


@pytest.mark.parametrize("argv", [
    ["up", "--prefil", "2"],
    ["experiment", "report", "--gate", "127.0.0.1:1"],  # a nested subcommand
    ["gateway", "--api-keys", SECRET],  # once read as --api-keys-file, then printed as a path
    ["up", "--api-k", SECRET],
])
def test_an_abbreviation_is_refused_without_echoing_its_value(capsys, argv: list[str]) -> None:
    err = usage_error(capsys, argv)
    assert "unrecognized arguments" in err and SECRET not in err and "127.0.0.1:1" not in err


def test_errors_about_keys_never_show_them(capsys) -> None:
    err = usage_error(capsys, ["gateway", "--max-model-len", SECRET])
    assert "--max-model-len" in err and SECRET not in err
    with pytest.raises(ValueError, match="--api-key") as bad:
        gateway_config(["--api-key", f"{SECRET} extra"])
    assert SECRET not in str(bad.value)
    assert SECRET not in repr(gateway_config(["--api-key", SECRET]))  # nor does a logged config


def test_help_shows_every_default() -> None:
    for command in ("up", "gateway"):
        parser = next(p for p in parsers(build_parser()) if p.prog == f"pdserve {command}")
        formatter = parser._get_formatter()  # the one --help uses
        for action in parser._actions:
            if not action.option_strings or action.default in (None, argparse.SUPPRESS):
                continue
            text = formatter._expand_help(action) if action.help else ""
            assert "default: " in text, (command, action.option_strings, text)
        assert "(default: the model's context window)" in " ".join(parser.format_help().split())


# ---- the new flags parse ---------------------------------------------------------------------------

def test_gateway_flags_parse_to_the_config() -> None:
    config = gateway_config([
        "--host", "0.0.0.0", "--port", "8123", "--served-model-name", "tiny", "--api-key", "sk-a",
        "--api-key", "sk-b,sk-c", "--allowed-origins", "http://localhost:3000,https://app.example",
        "--allowed-origins", "*", "--max-model-len", "128", "--dtype", "bfloat16"])
    assert (config.http_host, config.http_port, config.served_model_name) == ("0.0.0.0", 8123, "tiny")
    assert config.api_keys == ("sk-a", "sk-b", "sk-c") and config.max_model_len == 128
    assert config.cors.origins == ("http://localhost:3000", "https://app.example", "*")
    assert config.dtype == "bfloat16"  # the workers' compute dtype: part of every block hash
    assert gateway_config(["--http-port", "9"]).http_port == 9  # the old spelling still works
    assert http_bind_of(config.bind, config.http_port, config.http_host) == "0.0.0.0:8123"
    assert http_bind_of("127.0.0.1:50051", 8000) == "127.0.0.1:8000"  # --host defaults to --bind's host
    assert http_bind_of("127.0.0.1:50051", 8000, "::1") == "[::1]:8000"


def test_gateway_flags_have_variables_and_defaults() -> None:
    config = gateway_config([], {"PDSERVE_API_KEY": "sk-1,sk-2", "PDSERVE_ALLOWED_ORIGINS": "http://a.example"})
    assert config.api_keys == ("sk-1", "sk-2") and config.cors.origins == ("http://a.example",)
    default = gateway_config([])
    assert (default.api_keys, default.allowed_origins, default.max_model_len, default.http_host) == ((), (), None, None)
    assert not default.cors.enabled


@pytest.mark.parametrize(("argv", "flag"), [
    (["--allowed-origins", "ftp://files.example"], "--allowed-origins"),
    (["--allowed-origins", "http://app.example/path"], "--allowed-origins"),
    (["--max-model-len", "0"], "--max-model-len"),
])
def test_a_bad_value_is_refused_naming_its_flag(argv: list[str], flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        gateway_config(argv)


def test_up_takes_the_gateway_flags_and_hands_them_on() -> None:
    args = build_parser().parse_args([
        "up", "--host", "127.0.0.1", "--port", "8124", "--served-model-name", "tiny", "--api-key", SECRET,
        "--allowed-origins", "http://localhost:3000", "--max-model-len", "64", "--api-keys-file", "/run/keys",
        "--dtype", "float32", "--no-internal-token"])
    assert args.http_port == 8124
    _, gateway = plan(args)
    command = list(gateway.command)
    forwarded = gateway_config(command[command.index("gateway") + 1:], dict(gateway.env))
    assert forwarded.http_port == 8124 and forwarded.bind.startswith("127.0.0.1:")
    assert forwarded.served_model_name == "tiny" and forwarded.dtype == "float32"
    assert forwarded.cors.origins == ("http://localhost:3000",) and forwarded.max_model_len == 64
    assert forwarded.api_keys == (SECRET,) and forwarded.api_keys_file == "/run/keys"
    assert SECRET not in " ".join(command)  # the key travels in the environment, not where `ps` shows it


# ---- --max-model-len over the model's window: one line, nothing started ----------------------------

def test_max_model_len_over_the_window_is_one_line(capsys) -> None:
    window = context_length(STORIES)
    for argv in (["up", "--max-model-len", str(window + 1)],
                 ["gateway", "--prefill", "127.0.0.1:1", "--decode", "127.0.0.1:1", "--bind", "127.0.0.1:0",
                  "--http-port", "0", "--max-model-len", str(window + 1)]):
        args = build_parser().parse_args(argv)
        assert args._run(args) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and "--max-model-len" in err and f"context window of {window} tokens" in err, err


@pytest.mark.parametrize("argv,says", [
    (["--weight-format", "int4"], "down_proj.weight has 172; serve this model with --weight-format dense"),
    (["--num-blocks", "0"], "num_blocks must be positive, got 0"),
])
def test_flags_a_model_cannot_run_with_are_one_line(capsys, argv: list[str], says: str) -> None:
    """A ConfigError (stories260K's 172-wide MLP does not pack in groups of 32; an empty cache) ends
    the command with its message and status 2, not a traceback."""
    from pdserve.cli import main

    assert main(["bench-engine", "--model", str(STORIES_GGUF), "--skip-hf", "--num-requests", "1", *argv]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err and err.count("\n") == 1
