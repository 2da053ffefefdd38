"""Settings: a flag beats the environment, the environment beats the default; errors name the source."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pytest

from kvshard.settings import SettingsError, add_arguments, describe, env_setting, from_sources, setting


@dataclass(frozen=True)
class Example:
    port: int = setting(8100, "port")
    name: str = setting("pod", "name")
    folder: Path | None = setting(None, "folder")
    verbose: bool = setting(False, "chatty")
    mode: Literal["a", "b"] = setting("a", "mode")
    peers: tuple[str, ...] = setting((), "peers")
    token: str = setting("", "secret", secret=True)


def parse(argv: list[str], env: dict[str, str]) -> Example:
    parser = argparse.ArgumentParser()
    add_arguments(parser, Example, "KVX_")
    return from_sources(Example, parser.parse_args(argv), "KVX_", env)


def test_defaults_apply_when_nothing_is_set() -> None:
    assert parse([], {}) == Example()


def test_env_overrides_default_and_flag_overrides_env() -> None:
    env = {"KVX_PORT": "9000", "KVX_NAME": "from-env", "KVX_VERBOSE": "true", "KVX_PEERS": "http://a, http://b"}
    settings = parse(["--port", "9100"], env)
    assert settings.port == 9100 and settings.name == "from-env" and settings.verbose is True
    assert settings.peers == ("http://a", "http://b")
    assert parse(["--no-verbose", "--folder", "/x"], env).verbose is False
    assert parse(["--folder", "/x"], {}).folder == Path("/x")


def test_bad_env_values_name_the_variable() -> None:
    with pytest.raises(SettingsError, match="KVX_PORT"):
        parse([], {"KVX_PORT": "eighty"})
    with pytest.raises(SettingsError, match="KVX_MODE"):
        parse([], {"KVX_MODE": "c"})
    with pytest.raises(SettingsError, match="KVX_VERBOSE"):
        parse([], {"KVX_VERBOSE": "maybe"})


def test_secrets_come_only_from_the_environment_and_are_masked() -> None:
    with pytest.raises(SystemExit):
        parse(["--token", "x"], {})
    settings = parse([], {"KVX_TOKEN": "s3cret"})
    assert settings.token == "s3cret"
    assert describe(settings)["token"] == "***"


@dataclass(frozen=True)
class WithAliases:
    zones: tuple[str, ...] = setting((), "zones", flags=("--zone", "-z"), repeatable=True)
    hosts: tuple[str, ...] = setting((), "hosts", flags=("-H",))


def test_more_flags_and_repeatable_lists() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser, WithAliases, "KVY_")
    args = parser.parse_args(["--zone", "a", "-z", "b,c", "--zones", "d", "-H", "h1", "--hosts", "h2"])
    settings = from_sources(WithAliases, args, "KVY_", {"KVY_ZONES": "env"})
    assert settings.zones == ("a", "b", "c", "d"), "each occurrence of a repeatable flag adds to the list"
    assert settings.hosts == ("h2",), "a plain list flag keeps its last occurrence"
    assert from_sources(WithAliases, parser.parse_args([]), "KVY_", {"KVY_ZONES": "x,y"}).zones == ("x", "y")


def test_one_setting_from_the_environment_alone() -> None:
    assert env_setting(Example, "KVX_", "mode", {}) == "a"
    assert env_setting(Example, "KVX_", "mode", {"KVX_MODE": "b", "KVX_PORT": "not read"}) == "b"
    assert env_setting(Example, "KVX_", "folder", {"KVX_FOLDER": "/f"}) == Path("/f")
    with pytest.raises(SettingsError, match="KVX_MODE"):
        env_setting(Example, "KVX_", "mode", {"KVX_MODE": "c"})
