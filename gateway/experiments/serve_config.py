"""The gateway's one configuration file: named deployments and the experiments over them (TOML).

    default_model = "stories"                   # the model of requests that name none (optional;
                                                # default: the first experiment, else deployment)
    [deployments.stories-fp32]                  # a deployment: one model, its own workers and KV
    model = "stories260K.gguf"                  # GGUF file or HF/GPTQ directory (`pdserve quantize`
                                                # output); relative to this file's directory
    kv_dtype = "float32"                        # float32 | float16 | bfloat16 (default float32)
    block_size = 16                             # tokens per KV block (default 16)
    prefill = 1                                 # workers `pdserve up --config` starts (default:
    decode = 1                                  #   up's --prefill / --decode)
    num_blocks = 1024                           # KV blocks per worker (default: up's --num-blocks)
    prefill_targets = ["10.0.0.5:50061"]        # for `pdserve gateway --config`: running workers
    decode_targets = ["10.0.0.6:50062"]         #   (`up --config` fills these in itself)
    kvstore_target = "10.0.0.7:50070"           # this deployment's own kvstore (optional)

    [experiments.stories]                       # see gateway.experiments.config
    arms = ["stories-fp32", "stories-int8"]
    policy = "thompson"

Every error is an `ExperimentConfigError` whose one-line message starts with the field's path. The
`--deployment-targets NAME:KIND=ADDR[,ADDR]` flag of `pdserve gateway` fills in targets (`up` uses
it so that the file it was given stays as written).
"""

from __future__ import annotations

import dataclasses
import re
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.experiments.config import (ExperimentConfig, ExperimentConfigError, _table, _unknown_keys,
                                        parse_experiment)
from pdserve.runtime.config import KV_DTYPE_NAMES as KV_DTYPES  # as `pdserve up --kv-dtype`
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")  # also a process name and a metrics label
TARGET_KINDS = ("prefill", "decode", "kvstore")
DEPLOYMENT_KEYS = {"model", "kv_dtype", "block_size", "prefill", "decode", "num_blocks",
                   "prefill_targets", "decode_targets", "kvstore_target"}
TOP_LEVEL_KEYS = {"default_model", "deployments", "experiments"}


@dataclass(frozen=True)
class DeploymentConfig:
    """One deployment: a model in one format with its own prefill/decode workers and KV namespace."""

    name: str
    model: str  # absolute path of the GGUF file or checkpoint directory
    kv_dtype: str = "float32"
    block_size: int = 16
    prefill: int | None = None  # workers `up --config` starts; None: up's --prefill
    decode: int | None = None
    num_blocks: int | None = None  # KV blocks per worker; None: up's --num-blocks
    prefill_targets: tuple[str, ...] = ()  # running workers, for `pdserve gateway --config`
    decode_targets: tuple[str, ...] = ()
    kvstore_target: str | None = None


@dataclass(frozen=True)
class ServeConfig:
    """The whole file: deployments by name, experiments by public model name, the default model."""

    deployments: Mapping[str, DeploymentConfig]
    experiments: Mapping[str, ExperimentConfig]
    default_model: str

    def public_names(self) -> list[str]:
        """Every model name a client may ask for: experiments first, then deployments."""
        return [*self.experiments, *self.deployments]

    def require_targets(self) -> None:
        """Every deployment has prefill and decode targets (what `pdserve gateway --config` needs)."""
        for dep in self.deployments.values():
            for kind in ("prefill", "decode"):
                if not getattr(dep, f"{kind}_targets"):
                    raise ExperimentConfigError(
                        f"deployments.{dep.name}.{kind}_targets: required by `pdserve gateway --config` "
                        f"(set it in the file or pass --deployment-targets {dep.name}:{kind}=ADDR; "
                        f"`pdserve up --config` starts the workers and fills it in)")

    def with_targets(self, flags: Iterable[str]) -> ServeConfig:
        """This config with `NAME:KIND=ADDR[,ADDR]` flags (--deployment-targets) applied."""
        deployments = dict(self.deployments)
        for flag in flags:
            name, kind, addresses = parse_target_flag(flag, deployments)
            value: Any = addresses[0] if kind == "kvstore" else addresses
            deployments[name] = dataclasses.replace(deployments[name], **{_target_field(kind): value})
        return dataclasses.replace(self, deployments=deployments)


def _target_field(kind: str) -> str:
    return "kvstore_target" if kind == "kvstore" else f"{kind}_targets"


def target_flag(name: str, kind: str, addresses: Iterable[str]) -> str:
    """The --deployment-targets value that `parse_target_flag` reads back."""
    return f"{name}:{kind}={','.join(addresses)}"


def parse_target_flag(flag: str, deployments: Mapping[str, DeploymentConfig]) -> tuple[str, str, tuple[str, ...]]:
    """(deployment, kind, addresses) of `NAME:KIND=ADDR[,ADDR]`; ExperimentConfigError when malformed."""
    where = f"--deployment-targets {flag!r}"
    head, eq, tail = flag.partition("=")
    name, colon, kind = head.rpartition(":")
    addresses = tuple(a for a in tail.split(",") if a)
    if not (eq and colon and addresses):
        raise ExperimentConfigError(f"{where}: expected NAME:KIND=ADDR[,ADDR], e.g. stories-fp32:prefill=127.0.0.1:50061")
    if name not in deployments:
        raise ExperimentConfigError(f"{where}: unknown deployment {name!r}; deployments are "
                                    f"{', '.join(deployments)}")
    if kind not in TARGET_KINDS:
        raise ExperimentConfigError(f"{where}: unknown kind {kind!r}; expected one of {', '.join(TARGET_KINDS)}")
    if kind == "kvstore" and len(addresses) != 1:
        raise ExperimentConfigError(f"{where}: a deployment has one kvstore, got {len(addresses)} addresses")
    return name, kind, addresses


def _positive_int(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ExperimentConfigError(f"{where}: must be an integer >= 1, got {value!r}")
    return value


def _targets(value: Any, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(t, str) and t for t in value):
        raise ExperimentConfigError(f"{where}: must be a list of host:port strings, got {value!r}")
    return tuple(value)


def _name(name: str, where: str) -> None:
    if not NAME_PATTERN.fullmatch(name):
        raise ExperimentConfigError(f"{where}: the name {name!r} must be letters, digits, '.', '_' or '-', "
                                    f"starting with a letter or digit")


def _model_path(value: Any, where: str, base: Path) -> str:
    if not isinstance(value, str) or not value:
        raise ExperimentConfigError(f"{where}: must be the path of a GGUF file or checkpoint directory, got {value!r}")
    path = (base / Path(value).expanduser()).resolve()
    if not path.exists():
        raise ExperimentConfigError(f"{where}: no such file or directory: {path}")
    return str(path)


def parse_deployment(name: str, table: Any, base: Path) -> DeploymentConfig:
    """One `[deployments.<name>]` table, validated; relative model paths are taken from `base`."""
    where = f"deployments.{name}"
    _name(name, where)
    table = _table(table, where)
    _unknown_keys(table, DEPLOYMENT_KEYS, where)
    if "model" not in table:
        raise ExperimentConfigError(f"{where}.model: required (a GGUF file or checkpoint directory)")
    fields: dict[str, Any] = {"model": _model_path(table["model"], f"{where}.model", base)}
    kv_dtype = table.get("kv_dtype", "float32")
    if kv_dtype not in KV_DTYPES:
        raise ExperimentConfigError(f"{where}.kv_dtype: unknown dtype {kv_dtype!r}; choose one of {', '.join(KV_DTYPES)}")
    fields["kv_dtype"] = kv_dtype
    for key in ("block_size", "prefill", "decode", "num_blocks"):
        if key in table:
            fields[key] = _positive_int(table[key], f"{where}.{key}")
    for key in ("prefill_targets", "decode_targets"):
        if key in table:
            fields[key] = _targets(table[key], f"{where}.{key}")
    if "kvstore_target" in table:
        fields["kvstore_target"] = _targets([table["kvstore_target"]], f"{where}.kvstore_target")[0]
    return DeploymentConfig(name=name, **fields)


def parse_serve_config(data: Mapping[str, Any], base: Path = Path(".")) -> ServeConfig:
    """A parsed TOML document with deployments and experiments, validated as a whole."""
    _unknown_keys(data, TOP_LEVEL_KEYS, "(top level)")
    tables = _table(data.get("deployments", {}), "deployments")
    if not tables:
        raise ExperimentConfigError("deployments: at least one [deployments.<name>] table is required")
    deployments = {name: parse_deployment(name, table, base) for name, table in tables.items()}
    experiments = {model: parse_experiment(model, table, deployments)
                   for model, table in _table(data.get("experiments", {}), "experiments").items()}
    for model in experiments:
        _name(model, f"experiments.{model}")
        if model in deployments:
            raise ExperimentConfigError(f"experiments.{model}: the name is also a deployment's; a client "
                                        f"could not tell them apart")
    names = [*experiments, *deployments]
    default = data.get("default_model", names[0])
    if default not in names:
        raise ExperimentConfigError(f"default_model: unknown model {default!r}; the file serves {', '.join(names)}")
    return ServeConfig(deployments, experiments, default)


def load_serve_config(path: str | Path) -> ServeConfig:
    """Read and validate the file at `path`; ExperimentConfigError naming the field when it is wrong."""
    path = Path(path).expanduser()
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise ExperimentConfigError(f"{path}: cannot read the config file: {err.strerror or err}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ExperimentConfigError(f"{path}: not valid TOML: {err}") from None
    return parse_serve_config(data, path.resolve().parent)


__all__ = ["DeploymentConfig", "ExperimentConfigError", "ServeConfig", "load_serve_config",
           "parse_serve_config", "parse_target_flag", "target_flag"]
