"""``python -m kvshard_operator [options]`` — the same as ``kvshard operator run``."""

from kvshard_operator.main import run

raise SystemExit(run())
