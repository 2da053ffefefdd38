"""kubectl for the tests that drive the local cluster's API as a user would.

The binary is kubectl 1.37 from the user cache, installed by ``charts/install-tools.sh`` (with helm,
see ``tests/chart/chart_helpers.py``). Each :class:`Kubectl` has its own discovery cache folder: the
local API listens on a free port, and a cache left by an earlier API on the same port would answer
for it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
INSTALL_TOOLS = REPO / "charts" / "install-tools.sh"


class KubectlUnavailableError(RuntimeError):
    """charts/install-tools.sh could not install kubectl."""


def kubectl_binary() -> Path:
    """kubectl from the user cache, installed by ``charts/install-tools.sh`` if missing."""
    result = subprocess.run(["bash", str(INSTALL_TOOLS)], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHON": sys.executable})
    if result.returncode != 0:
        raise KubectlUnavailableError(f"charts/install-tools.sh failed: {result.stderr.strip()[-2000:]}")
    return Path(result.stdout.strip().splitlines()[-1]) / "kubectl"


class Kubectl:
    """``kubectl`` against one kubeconfig; calls return the finished process (text output)."""

    def __init__(self, binary: Path, kubeconfig: Path, cache_dir: Path) -> None:
        self.binary = binary
        self.env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
        self.cache_dir = cache_dir

    def __call__(self, *args: str, check: bool = True, timeout: float = 60,
                 env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        done = subprocess.run([str(self.binary), "--cache-dir", str(self.cache_dir), *args], capture_output=True,
                              text=True, timeout=timeout, env={**self.env, **(env or {})}, check=False)
        if check and done.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} exited {done.returncode}:\n{done.stderr}{done.stdout}")
        return done

    def popen(self, *args: str) -> subprocess.Popen[str]:
        return subprocess.Popen([str(self.binary), "--cache-dir", str(self.cache_dir), *args], env=self.env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
