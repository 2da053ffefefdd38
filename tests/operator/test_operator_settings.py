"""`kvshard operator run`'s settings: the shared helper's flags and env, and the handlers get them all."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys

import pytest

from kvshard.settings import SettingsError
from kvshard_operator import main as operator_main
from kvshard_operator.settings import ENV_PREFIX, Settings


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    operator_main.add_arguments(parser)
    return parser.parse_args(argv)


def test_the_flags_it_always_had_still_work() -> None:
    args = parse(["--namespace", "a", "-n", "b,c", "--no-peering", "--liveness-endpoint", "http://127.0.0.1:1/h",
                  "--metrics-port", "0", "--seed", "4", "--recluster-imbalance-percent", "0", "--verbose"])
    settings = Settings.from_args(args, {})
    assert settings.namespaces == ("a", "b", "c")
    assert (settings.peering, settings.liveness_endpoint, settings.metrics_port) == (False, "http://127.0.0.1:1/h", 0)
    assert (settings.seed, settings.recluster_imbalance_percent, args.verbose) == (4, 0, True)
    assert Settings.from_args(parse(["--peering", "-v"]), {}).peering is True


def test_every_setting_is_a_documented_flag_and_variable() -> None:
    parser = argparse.ArgumentParser()
    operator_main.add_arguments(parser)
    flags = {action.dest: action for action in parser._actions}
    for field in dataclasses.fields(Settings):
        assert field.metadata.get("help"), f"{field.name} has no help"
        assert field.name in flags, f"--{field.name.replace('_', '-')} missing"
        assert f"{ENV_PREFIX}{field.name.upper()}" in (flags[field.name].help or "")


def test_a_flag_beats_the_environment_which_beats_the_default() -> None:
    environ = {"KVSHARD_OPERATOR_SEED": "7", "KVSHARD_OPERATOR_POD_SYNC_SECONDS": "0.5",
               "KVSHARD_OPERATOR_NAMESPACES": "x, y", "KVSHARD_OPERATOR_PEERING": "on"}
    settings = Settings.from_args(parse(["--seed", "3", "--embedding-cpu", "2"]), environ)
    assert (settings.seed, settings.pod_sync_seconds, settings.namespaces) == (3, 0.5, ("x", "y"))
    assert (settings.embedding_cpu, settings.peering, settings.metrics_port) == ("2", True, 9090)
    with pytest.raises(SettingsError, match="KVSHARD_OPERATOR_PEERING"):
        Settings.from_env({"KVSHARD_OPERATOR_PEERING": "perhaps"})


HANDLERS_SETTINGS = """
import json, sys
import kopf
from kvshard.cli import build_parser
from kvshard_operator import main
argv = ["operator", "run", *sys.argv[1:]]
main.configure(build_parser(argv).parse_args(argv))
from kvshard_operator import handlers
intervals = {h.id: h.interval for h in kopf.get_default_registry()._spawning.get_all_handlers()}
print(json.dumps({"pod_sync_seconds": handlers.SETTINGS.pod_sync_seconds, "seed": handlers.SETTINGS.seed,
                  "warm_check_seconds": handlers.SETTINGS.warm_check_seconds,
                  "embedding_image": handlers.SETTINGS.embedding_image, "follow_pods": intervals["follow_pods"]}))
"""


def test_a_flag_of_operator_run_reaches_the_handlers_and_their_timers() -> None:
    """Handlers read their settings at import (kopf fixes timer intervals then): `kvshard operator run`
    configures them first, so every flag counts, not only those once handed over through the env. A
    fresh process, as `kvshard operator run` is one."""
    env = {key: value for key, value in os.environ.items() if not key.startswith(ENV_PREFIX)}
    env |= {"KVSHARD_OPERATOR_SEED": "9", "KVSHARD_OPERATOR_POD_SYNC_SECONDS": "3",
            "KVSHARD_OPERATOR_WARM_CHECK_SECONDS": "1.5"}
    done = subprocess.run([sys.executable, "-c", HANDLERS_SETTINGS, "--pod-sync-seconds", "0.7", "--seed", "5",
                           "--embedding-image", "kvshard:test"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen == {"pod_sync_seconds": 0.7, "seed": 5, "warm_check_seconds": 1.5, "embedding_image": "kvshard:test",
                    "follow_pods": 0.7}
