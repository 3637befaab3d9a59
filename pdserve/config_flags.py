"""Command-line flags and environment variables derived from config dataclasses: each setting once.

A field made with `setting(default, doc, ...)` carries everything about one setting: its
documentation (also its --help text), its flag (--field-name unless `flag` says otherwise; None:
environment only, as secrets and cluster-wide settings are), its environment variable if it has
one, and how a flag in other units maps to the field (`scale`: --x-ms for a field in seconds is
scale=1e3). A field made with `nested(cls, doc)` holds a config dataclass of its own, whose
settings count as the outer config's.

`add_flags(parser, cls)` adds one flag per setting, its default the field's (`%(default)s` in
--help, so the text cannot drift from the code). `build(cls, args, env)` makes the config; for each
setting, the first of: the flag when it was given on the command line, its environment variable
when set and not empty, the field's default. Only a service's main calls it (with the process
environment): everything below the main is handed the config it built.

A flag declared elsewhere (`external=True`: the worker flags of `pdserve.engine_args`, which
resolve their own environment defaults) is read from the parsed flags whenever present.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import Any

GIVEN_ATTR = "_flags_given"  # on a parsed Namespace: the dests set on the command line
LOG_LEVEL_ENV = "PDSERVE_LOG_LEVEL"  # every service's --log-level
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


class _Auto:
    def __repr__(self) -> str:
        return "AUTO"


AUTO: Any = _Auto()  # the flag of a setting: --field-name


def setting(default: Any = dataclasses.MISSING, doc: str = "", *, flag: str | None = AUTO,
            env: str | None = None, load: Callable[[Mapping[str, str]], Any] | None = None,
            type: Callable[[str], Any] | None = None, choices: Collection[Any] | None = None,
            metavar: str | None = None, scale: float | None = None, append: bool = False,
            split: str | None = None, aliases: tuple[str, ...] = (), shown: str | None = None,
            external: bool = False, repr: bool = True) -> Any:
    """A documented config field. `env`: its environment variable (in the flag's units); `load`:
    reads it from the environment some other way (a secret or its file), None when unset; `type`:
    of the flag's value when the default does not tell (None defaults); `scale`: flag value =
    field value x scale; `append`: a repeatable flag, the field a tuple; `split`: with `append`,
    each value (and the variable) may also list several items with this separator; `aliases`:
    more spellings of the flag; `shown`: the default's text in --help when it is None or empty;
    `external`: the flag is declared by another module; `repr=False` keeps a secret out of logs."""
    return dataclasses.field(default=default, repr=repr, metadata={
        "doc": doc, "flag": flag, "env": env, "load": load, "type": type, "choices": choices,
        "metavar": metavar, "scale": scale, "append": append, "split": split, "aliases": aliases,
        "shown": shown, "external": external})


def nested(cls: type, doc: str) -> Any:
    """A field holding the config dataclass `cls` (its defaults by default); its settings are the
    outer config's."""
    return dataclasses.field(default_factory=cls, metadata={"doc": doc, "nested": cls})


@dataclasses.dataclass(frozen=True, slots=True)
class Setting:
    """One leaf setting of a config class, as `settings` finds it."""

    path: tuple[str, ...]  # field names from the outer config down
    field: dataclasses.Field

    @property
    def meta(self) -> Mapping[str, Any]:
        return self.field.metadata

    @property
    def name(self) -> str:
        return ".".join(self.path)

    @property
    def flag(self) -> str | None:
        flag = self.meta["flag"]
        return "--" + self.field.name.replace("_", "-") if flag is AUTO else flag

    @property
    def dest(self) -> str | None:
        return self.flag[2:].replace("-", "_") if self.flag else None

    @property
    def env(self) -> str | None:
        return self.meta["env"]

    @property
    def default(self) -> Any:
        f = self.field
        return f.default_factory() if f.default is dataclasses.MISSING else f.default

    @property
    def value_type(self) -> Callable[[str], Any]:
        """What the flag (and the environment variable) parse: in the flag's units, so a scaled
        setting is a float whatever the field is."""
        if self.meta["type"] is not None:
            return self.meta["type"]
        if self.meta["scale"]:
            return float
        default = self.default
        return builtin_type(default) if default is not None else str

    def to_flag(self, value: Any) -> Any:
        scale = self.meta["scale"]
        return value * scale if scale and value is not None else value

    def from_flag(self, value: Any) -> Any:
        if self.meta["append"]:
            sep = self.meta["split"]
            items = value or ()
            return tuple(p.strip() for v in items for p in v.split(sep) if p.strip()) if sep else tuple(items)
        scale = self.meta["scale"]
        if scale and value is not None:
            value = value / scale
            if builtin_type(self.default) is int:
                value = int(value)
        return value

    def from_env(self, raw: str) -> Any:
        if self.meta["append"]:  # one item, or several with the setting's separator
            return self.from_flag([raw])
        kind = self.value_type
        try:
            value = parse_bool(raw) if kind is bool else kind(raw)
        except ValueError:
            what = {bool: f"one of {'/'.join(TRUE_WORDS)} or {'/'.join(FALSE_WORDS)}", int: "a whole number",
                    float: "a number"}.get(kind, "valid")
            raise ValueError(f"{self.env} must be {what}, got {raw!r}") from None
        choices = self.meta["choices"]
        if choices is not None and value not in choices:
            raise ValueError(f"{self.env} must be one of {', '.join(map(str, choices))}, got {raw!r}")
        return self.from_flag(value)

    def read(self, args: argparse.Namespace | None, env: Mapping[str, str]) -> tuple[bool, Any]:
        """(found, value): the flag if given (always, when declared elsewhere), else the environment."""
        dest = self.dest
        if args is not None and dest is not None and hasattr(args, dest):
            if self.meta["external"] or dest in getattr(args, GIVEN_ATTR, ()):
                return True, self.from_flag(getattr(args, dest))
        raw = env.get(self.env, "").strip() if self.env else ""
        if raw:
            return True, self.from_env(raw)
        if self.meta["load"] is not None:
            value = self.meta["load"](env)
            if value is not None:
                return True, value
        return False, None


def builtin_type(value: Any) -> type:
    """bool, int, float or str: what a flag of this default's kind parses (str for anything else)."""
    for kind in (bool, int, float):
        if isinstance(value, kind):
            return kind
    return str


def parse_bool(raw: str) -> bool:
    word = raw.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise ValueError(raw)


def check_log_level(level: str) -> str:
    """`level` when logging knows it (any case); ValueError naming --log-level otherwise."""
    if not isinstance(logging.getLevelName(level.upper()), int):
        raise ValueError(f"--log-level / {LOG_LEVEL_ENV} must be one of DEBUG, INFO, WARNING, ERROR, CRITICAL, "
                         f"got {level!r}")
    return level


def settings(cls: type, path: tuple[str, ...] = ()) -> Iterator[Setting]:
    """The leaf settings of config class `cls`, nested configs' included, in field order."""
    for f in dataclasses.fields(cls):
        if "nested" in f.metadata:
            yield from settings(f.metadata["nested"], (*path, f.name))
        elif "doc" in f.metadata:
            yield Setting((*path, f.name), f)


def flag_of(cls: type, name: str) -> str:
    """How a person sets field `name` ("a.b" for nested): its flag, else its environment variable."""
    s = next(s for s in settings(cls) if s.name == name)
    return s.flag or s.env or name


def add_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type, *,
              only: Collection[str] = (), skip: Collection[str] = ()) -> None:
    """Add a flag for every setting of `cls` that has one (not `external`); `only` / `skip` name
    settings or nested configs by their dotted path."""
    def chosen(s: Setting) -> bool:
        prefixes = {".".join(s.path[:i]) for i in range(1, len(s.path) + 1)}
        return (not only or bool(prefixes & set(only))) and not prefixes & set(skip)
    for s in settings(cls):
        if s.flag is None or s.meta["external"] or not chosen(s):
            continue
        default = s.to_flag(s.default)
        kwargs: dict[str, Any] = {"dest": s.dest, "default": default, "help": _help(s)}
        if s.meta["metavar"]:
            kwargs["metavar"] = s.meta["metavar"]
        if s.meta["choices"] is not None:
            kwargs["choices"] = list(s.meta["choices"])
        if s.meta["append"]:
            kwargs.update(action=_Append, default=[])
        elif s.value_type is bool:
            kwargs["action"] = _StoreBool
        else:
            kwargs.update(action=_Store, type=s.value_type)
        parser.add_argument(s.flag, *s.meta["aliases"], **kwargs)


def _help(s: Setting) -> str:
    doc = s.meta["doc"].replace("%", "%%")
    default = s.meta["shown"] if s.meta["shown"] is not None else "%(default)s"
    where = f"${s.env}, else {default}" if s.env else default
    return f"{doc} (default: {where})"


def build(cls: type, args: argparse.Namespace | None, env: Mapping[str, str]) -> Any:
    """An instance of config class `cls` from parsed flags (None: none) and an environment; each
    setting as the module docstring says. ValueError (naming the flag or variable) when one is bad."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if "nested" in f.metadata:
            values[f.name] = build(f.metadata["nested"], args, env)
        elif "doc" in f.metadata:
            found, value = Setting((f.name,), f).read(args, env)
            if found:
                values[f.name] = value
    return cls(**values)


class FromFlags:
    """Base of a service's config dataclass whose fields are `setting`s: its one builder."""

    __slots__ = ()

    @classmethod
    def from_args(cls, args: argparse.Namespace | None, env: Mapping[str, str]) -> Any:
        """The config of parsed flags and the environment `env` (a service's main passes the process
        environment); ValueError naming the flag or variable when a value is bad."""
        return build(cls, args, env)


def _mark(namespace: argparse.Namespace, dest: str) -> None:
    given = getattr(namespace, GIVEN_ATTR, None)
    if given is None:
        given = set()
        setattr(namespace, GIVEN_ATTR, given)
    given.add(dest)


class _Store(argparse.Action):
    """Stores the value, and notes that the flag was given (it then wins over the environment)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        setattr(namespace, self.dest, values)
        _mark(namespace, self.dest)


class _StoreBool(argparse.BooleanOptionalAction):
    """--name / --no-name, noted as given."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        super().__call__(parser, namespace, values, option_string)
        _mark(namespace, self.dest)


class _Append(argparse.Action):
    """A repeatable flag (a fresh list per parse: the default is never appended to), noted as given."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        setattr(namespace, self.dest, [*(getattr(namespace, self.dest, None) or ()), values])
        _mark(namespace, self.dest)
