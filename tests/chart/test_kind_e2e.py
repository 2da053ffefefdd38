"""The kind e2e (``e2e/kind-e2e.sh``): skipped, with the script's own reason, where Docker or kind
is missing; where both are there it runs in full (image builds, model load: tens of minutes) when
``KVSHARD_E2E_KIND=1`` is set, as ``make e2e-kind`` does."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from chart_helpers import REPO

SCRIPT = REPO / "e2e" / "kind-e2e.sh"


def _run(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHON": sys.executable})


def test_kind_e2e_check_mode_answers_and_exits_zero() -> None:
    result = _run("--check", timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(("SKIP: kind e2e needs ", "READY: "))


@pytest.mark.slow
def test_kind_e2e() -> None:
    check = _run("--check", timeout=60)
    if check.stdout.startswith("SKIP: "):
        pytest.skip(check.stdout.strip().removeprefix("SKIP: "))
    if os.environ.get("KVSHARD_E2E_KIND") != "1":
        pytest.skip("Docker and kind are here; set KVSHARD_E2E_KIND=1 (or run `make e2e-kind`) to run the kind e2e")
    result = _run(timeout=3600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "kind e2e passed" in result.stdout
