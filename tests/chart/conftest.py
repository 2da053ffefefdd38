"""Fixtures of the chart checks: helm (installed once into the user cache) and rendered values files."""

from __future__ import annotations

from pathlib import Path

import pytest
from chart_helpers import VALUES_CASES, HelmError, Manifest, install_helm, render


@pytest.fixture(scope="session")
def helm_bin() -> Path:
    try:
        return install_helm()
    except (HelmError, OSError) as error:
        pytest.skip(f"helm unavailable (charts/install-tools.sh could not install it): {error}")


@pytest.fixture(scope="session")
def rendered(helm_bin: Path) -> dict[str, list[Manifest]]:
    """Every values case rendered once: name → objects."""
    return {name: render(helm_bin, values) for name, values in VALUES_CASES.items()}
