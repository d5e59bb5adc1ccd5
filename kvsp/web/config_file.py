"""Settings for ``kvsp serve SERVICE`` and the relay from a TOML file and ``KVSP_*`` variables.

Every flag of a service's parser can come from three more places than the command line; the
first that gives it wins:

1. the command line;
2. the environment: ``KVSP_<FLAG>``, the long flag name upper-cased with dashes as
   underscores (``--index-token-file`` is ``KVSP_INDEX_TOKEN_FILE``);
3. the file of ``--config FILE`` (or ``KVSP_CONFIG``): TOML whose keys are long flag names
   without the dashes. Top-level keys apply to every service; a table named after the service
   (``[holder]``, ``[relay]``, ...) overrides them for that service;
4. the flag's default.

It is done once, at the parser: :class:`ConfigArgumentParser` turns the settings of the
environment and the file into command-line words placed before the real ones, so that every
value goes through the flag's own ``type``, ``choices`` and ``required`` checks and a bad one
is reported as argparse reports it, with where it came from. A flag given on the command line
takes nothing from the environment or the file, so a repeatable flag is never a mix of sources.
A list value repeats a repeatable flag (``tier = ["host=2GiB", "disk=100GiB"]``) and is one
comma-separated value for any other (the form the several-URL flags ``--pc``
and ``--index`` take); ``true`` gives a flag that takes no value, ``false`` leaves it out.

A key or a ``KVSP_`` variable that names no flag of the service is an error (exit status 2):
a misspelt setting never passes unnoticed. The variables in :data:`RESERVED_VARIABLES` mean
other things to this project and are left alone. Secrets come only from ``*-file`` flags, so
neither the file nor the environment ever holds a token, and ``--print-config`` (the effective
settings as TOML, each with its source) prints file paths, never a secret.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from kvsp.web.cliargs import DeprecatedAlias

ENV_PREFIX = "KVSP_"

SERVICE_TABLES = frozenset({"index", "control", "pc", "holder", "instance", "relay"})
"""The tables a config file may hold: one per ``kvsp serve`` service."""

RESERVED_VARIABLES = frozenset(
    {
        # the scale-up hook's context, given to the command the PC runs (kvsp.services.pc.app)
        "KVSP_SCOPE_ID",
        "KVSP_COMPAT_ID",
        "KVSP_PROMPT_TOKENS",
        "KVSP_MATCHED",
        "KVSP_REQUEST_REF",
        "KVSP_ACTIVE",
        # the test suite, the interop runner and the benchmarks
        "KVSP_SHARED",
        "KVSP_REDIS_URL",
        "KVSP_INTEROP_CACHE",
        "KVSP_BENCH_CACHE",
        "KVSP_BENCH_PROFILE",
    }
)
"""``KVSP_*`` variables that name no flag on purpose: they are never read as settings."""

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off", ""})
_NOT_SETTINGS = frozenset({"help", "config", "print-config"})


class ConfigError(Exception):
    """A config file or ``KVSP_*`` variable that cannot be used (one line, exit status 2)."""


@dataclass(frozen=True, slots=True)
class _Setting:
    """One flag's value from the environment or the file, as command-line words."""

    action: argparse.Action
    words: list[str]
    source: str


class ConfigArgumentParser(argparse.ArgumentParser):
    """An :class:`argparse.ArgumentParser` for one service whose flags may also come from
    ``KVSP_*`` variables and a ``--config`` TOML file (see the module docstring).

    ``service`` names the file's table for it; ``environ`` (default :data:`os.environ`, read
    when parsing) is for tests.
    """

    def __init__(
        self,
        *args: Any,
        service: str,
        environ: Mapping[str, str] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.service = service
        self._environ = environ
        self._settings: list[_Setting] = []
        self._given: dict[str, list[list[str]]] = {}
        self.add_argument(
            "--config",
            type=Path,
            metavar="FILE",
            help="TOML settings: keys are long flag names, a [SERVICE] table overrides the "
            "top level; the command line and KVSP_<FLAG> variables come first",
        )
        self.add_argument(
            "--print-config",
            action="store_true",
            help="print the effective settings as TOML, each with its source, and exit",
        )

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        """Parse the command line with the environment's and the file's settings put first."""
        words = list(sys.argv[1:] if args is None else args)
        self._given = {}
        if "-h" in words or "--help" in words:
            self._settings = []
        else:
            try:
                self._settings = self._collect(words)
            except ConfigError as exc:
                self.exit(2, f"{self.prog}: error: {exc}\n")
        extra = [word for setting in self._settings for word in setting.words]
        parsed, rest = super().parse_known_args(extra + words, namespace)
        if getattr(parsed, "print_config", False):
            sys.stdout.write(self.format_config(parsed, words))
            self.exit(0)
        return parsed, rest

    def error(self, message: str) -> NoReturn:
        """argparse's report (usage, then one line), naming where a bad value came from."""
        for setting in self._settings:
            if message.startswith(f"argument {'/'.join(setting.action.option_strings)}:"):
                message = f"{message} (from {setting.source})"
                break
        super().error(message)

    def _get_values(self, action: argparse.Action, arg_strings: list[str]) -> Any:
        # the words each flag was given, so that --print-config shows them as written
        self._given.setdefault(action.dest, []).append(list(arg_strings))
        return super()._get_values(action, arg_strings)

    def format_config(self, parsed: argparse.Namespace, words: Sequence[str]) -> str:
        """The effective settings of ``parsed`` as TOML: a key per flag with its source."""
        on_command_line = _mentioned(list(words), self._option_string_actions)
        sources = {setting.action: setting.source for setting in self._settings}
        lines = [f"# {self.prog}: effective settings (command line > KVSP_* > file > default)"]
        config = _config_path(list(words), self._current_environ())
        if config is not None:
            lines.append(f"# config: {config}")
        for name, action in self._flags().items():
            if name != _long_name(action):
                continue
            source = sources.get(action, "default")
            if action in on_command_line:
                source = "command line"
            value = self._effective(action, parsed)
            if value is None:
                lines.append(f"# {name}: not set ({source})")
            else:
                lines.append(f"{name} = {_toml(value)}  # {source}")
        return "\n".join(lines) + "\n"

    # Private

    def _flags(self) -> dict[str, argparse.Action]:
        """Settable flags by long name without the dashes (a deprecated spelling is for old
        command lines only: files and variables, which are new, use the one name)."""
        flags: dict[str, argparse.Action] = {}
        for action in self._actions:
            if isinstance(action, DeprecatedAlias):
                continue
            for option in action.option_strings:
                name = option[2:]
                if option.startswith("--") and name not in _NOT_SETTINGS:
                    flags[name] = action
        return flags

    def _current_environ(self) -> Mapping[str, str]:
        return os.environ if self._environ is None else self._environ

    def _collect(self, words: list[str]) -> list[_Setting]:
        flags = self._flags()
        on_command_line = _mentioned(words, self._option_string_actions)
        environ = self._current_environ()
        from_env = _env_settings(environ, flags, self.prog)
        config = _config_path(words, environ)
        from_file = {} if config is None else _file_settings(config, self.service, flags)
        settings: list[_Setting] = []
        for name, action in flags.items():
            if action in on_command_line or name != _long_name(action):
                continue
            setting = from_env.get(name) or from_file.get(name)
            if setting is not None:
                settings.append(setting)
        return settings

    def _effective(self, action: argparse.Action, parsed: argparse.Namespace) -> Any:
        value = getattr(parsed, action.dest, None)
        given = self._given.get(action.dest)
        if action.nargs == 0 or given is None:
            return value
        if isinstance(action, argparse._AppendAction | argparse._ExtendAction):
            return [word for occurrence in given for word in occurrence]
        last = given[-1]
        return last[0] if action.nargs is None and len(last) == 1 else last


def _long_name(action: argparse.Action) -> str:
    return next(o[2:] for o in action.option_strings if o.startswith("--"))


def _mentioned(words: list[str], options: Mapping[str, argparse.Action]) -> set[argparse.Action]:
    """The actions the command line gives (``--flag``, ``--flag=value``), up to ``--``."""
    found: set[argparse.Action] = set()
    for word in words:
        if word == "--":
            break
        action = options.get(word.split("=", 1)[0] if word.startswith("--") else word)
        if action is not None:
            found.add(action)
    return found


def _config_path(words: list[str], environ: Mapping[str, str]) -> Path | None:
    for i, word in enumerate(words):
        if word == "--":
            break
        if word.startswith("--config="):
            return Path(word.split("=", 1)[1])
        if word == "--config" and i + 1 < len(words):
            return Path(words[i + 1])
    text = environ.get(f"{ENV_PREFIX}CONFIG")
    return Path(text) if text else None


def _env_settings(
    environ: Mapping[str, str], flags: Mapping[str, argparse.Action], prog: str
) -> dict[str, _Setting]:
    settings: dict[str, _Setting] = {}
    for variable, text in environ.items():
        if not variable.startswith(ENV_PREFIX) or variable in RESERVED_VARIABLES:
            continue
        name = variable[len(ENV_PREFIX) :].lower().replace("_", "-")
        if name == "config":
            continue
        action = flags.get(name)
        if action is None or variable != env_variable(name):
            raise ConfigError(f"{variable} names no flag of {prog}")
        settings[name] = _Setting(action, _env_words(action, text, variable), variable)
    return settings


def env_variable(flag: str) -> str:
    """The environment variable of a long flag name: ``index-token-file`` ->
    ``KVSP_INDEX_TOKEN_FILE``."""
    return ENV_PREFIX + flag.lstrip("-").upper().replace("-", "_")


def _env_words(action: argparse.Action, text: str, variable: str) -> list[str]:
    if action.nargs != 0:
        return _value_words(action, [text])
    lowered = text.strip().lower()
    if lowered not in _TRUE | _FALSE:
        raise ConfigError(f"{variable}: expected true or false (1/0, yes/no, on/off), got {text!r}")
    return _switch_words(action, lowered in _TRUE)


def _file_settings(
    path: Path, service: str, flags: Mapping[str, argparse.Action]
) -> dict[str, _Setting]:
    document = _load_toml(path)
    for key, value in document.items():
        if isinstance(value, dict) and key not in SERVICE_TABLES:
            raise ConfigError(f"{path}: unknown table [{key}] (tables: {_tables()})")
    table = document.get(service, {})
    top = {k: v for k, v in document.items() if not isinstance(v, dict)}
    settings: dict[str, _Setting] = {}
    for where, values in ((str(path), top), (f"{path} [{service}]", table)):
        for key, value in values.items():
            action = flags.get(key)
            if action is None:
                raise ConfigError(f"{where}: unknown key {key!r}: no flag --{key} in {service}")
            settings[key] = _Setting(action, _file_words(action, value, f"{where} {key}"), where)
    return settings


def _tables() -> str:
    return ", ".join(f"[{name}]" for name in sorted(SERVICE_TABLES))


def _load_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"--config {path}: cannot read it: {exc.strerror or exc}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--config {path}: not TOML: {exc}") from None


def _file_words(action: argparse.Action, value: Any, where: str) -> list[str]:
    if action.nargs == 0:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        return _switch_words(action, value)
    values = value if isinstance(value, list) else [value]
    texts: list[str] = []
    for item in values:
        if isinstance(item, bool) or not isinstance(item, str | int | float):
            raise ConfigError(f"{where}: expected a string or a number, got {item!r}")
        texts.append(item if isinstance(item, str) else _number_text(item))
    if not isinstance(value, list):
        return _value_words(action, texts)
    if isinstance(action, argparse._AppendAction | argparse._ExtendAction):
        return [word for text in texts for word in _value_words(action, [text])]
    if action.nargs is None or action.nargs == "?":
        return _value_words(action, [",".join(texts)])
    return _value_words(action, texts)


def _number_text(value: int | float) -> str:
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return str(value)


def _value_words(action: argparse.Action, texts: list[str]) -> list[str]:
    option = "--" + _long_name(action)
    if len(texts) == 1 and action.nargs in (None, "?"):
        return [f"{option}={texts[0]}"]  # "=": a value that starts with "-" stays a value
    return [option, *texts]


def _switch_words(action: argparse.Action, on: bool) -> list[str]:
    if isinstance(action, argparse.BooleanOptionalAction):
        return ["--" + _long_name(action) if on else "--no-" + _long_name(action)]
    return ["--" + _long_name(action)] if on else []


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return _number_text(value) if math.isinf(value) else repr(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml(item) for item in value) + "]"
    return json.dumps(str(value))  # a TOML basic string: JSON's escapes are TOML's
