"""One typed settings object per component, read from flags, then ``KVSHARD_…`` env, then defaults.

Each component declares a dataclass whose fields carry their help text; this module turns it into
argparse flags (``--disk-bytes``) and environment variables (``KVSHARD_SIDECAR_DISK_BYTES``) so
``--help``, the Helm chart's env list and the code never drift apart. A flag beats the env, the env
beats the default. Supported field types: str, int, float, bool, Path, their optionals, ``Literal``
choices and ``tuple[str, ...]`` (comma-separated in the env).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


class SettingsError(ValueError):
    """A setting that cannot be parsed; the message names the flag or env variable."""


def setting(default: Any, help: str, *, choices: tuple[str, ...] | None = None, secret: bool = False) -> Any:
    """Declare a settings field with its help text (and choices for plain ``str`` fields)."""
    metadata = {"help": help, "choices": choices, "secret": secret}
    if isinstance(default, (list, dict, set)):
        raise TypeError("use a tuple default for list settings")
    return dataclasses.field(default=default, metadata=metadata)


def env_name(prefix: str, field_name: str) -> str:
    return f"{prefix}{field_name.upper()}"


def _unwrap(tp: Any) -> tuple[Any, bool]:
    """(inner type, optional?) for ``X | None``."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def _converter(tp: Any, name: str) -> Any:
    inner, optional = _unwrap(tp)
    origin = typing.get_origin(inner)
    if origin is typing.Literal:
        allowed = tuple(str(a) for a in typing.get_args(inner))

        def literal(text: str) -> str:
            if text not in allowed:
                raise SettingsError(f"{name}: {text!r} is not one of {', '.join(allowed)}")
            return text

        return literal
    if origin is tuple:
        return lambda text: tuple(part.strip() for part in text.split(",") if part.strip())
    if inner is bool:

        def boolean(text: str) -> bool:
            lowered = text.strip().lower()
            if lowered in ("1", "true", "yes", "on"):
                return True
            if lowered in ("0", "false", "no", "off"):
                return False
            raise SettingsError(f"{name}: {text!r} is not a boolean (true/false)")

        return boolean
    base = {str: str, int: int, float: float, Path: Path}.get(inner)
    if base is None:
        raise TypeError(f"unsupported settings type {tp!r} for {name}")

    def convert(text: str) -> Any:
        if optional and text == "":
            return None
        try:
            return base(text)
        except ValueError:
            raise SettingsError(f"{name}: {text!r} is not a valid {base.__name__}") from None

    return convert


def add_arguments(parser: argparse.ArgumentParser, cls: type[Any], env_prefix: str) -> None:
    """Add one flag per field of the settings dataclass ``cls``; help names the env variable."""
    hints = typing.get_type_hints(cls)
    group = parser.add_argument_group("settings", f"each flag can also be set with its {env_prefix}* variable")
    secrets = [env_name(env_prefix, f.name) for f in dataclasses.fields(cls) if f.metadata.get("secret")]
    if secrets:
        group.description = (f"{group.description}; secrets are read from the environment only "
                             f"({', '.join(secrets)}), never from flags that show in process lists")
    for field in dataclasses.fields(cls):
        if field.metadata.get("secret"):
            continue
        flag = "--" + field.name.replace("_", "-")
        env = env_name(env_prefix, field.name)
        shown = repr(field.default)
        help_text = f"{field.metadata.get('help', '')} [env {env}; default {shown}]".replace("%", "%%")
        inner, _ = _unwrap(hints[field.name])
        if inner is bool:
            group.add_argument(flag, dest=field.name, default=None, help=help_text,
                               action=argparse.BooleanOptionalAction)
        else:
            choices = field.metadata.get("choices")
            if typing.get_origin(inner) is typing.Literal:
                choices = tuple(str(a) for a in typing.get_args(inner))
            group.add_argument(flag, dest=field.name, default=None, help=help_text,
                               type=_converter(hints[field.name], flag), choices=choices)


def from_sources(cls: type[T], args: argparse.Namespace | None, env_prefix: str,
                 environ: Mapping[str, str] | None = None) -> T:
    """Build ``cls`` from parsed flags, then the environment, then field defaults."""
    environ = os.environ if environ is None else environ
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for field in dataclasses.fields(cls):  # type: ignore[arg-type]
        flag_value = getattr(args, field.name, None) if args is not None else None
        env = env_name(env_prefix, field.name)
        if flag_value is not None:
            values[field.name] = flag_value
        elif env in environ:
            value = _converter(hints[field.name], env)(environ[env])
            choices = field.metadata.get("choices")
            if choices and value not in choices:
                raise SettingsError(f"{env}: {value!r} is not one of {', '.join(choices)}")
            values[field.name] = value
    return cls(**values)


def describe(settings: Any) -> dict[str, Any]:
    """The settings as a dict for logs, with secrets masked."""
    out = {}
    for field in dataclasses.fields(settings):
        value = getattr(settings, field.name)
        out[field.name] = "***" if field.metadata.get("secret") and value else value
    return out
