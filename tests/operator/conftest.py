"""The local cluster's Kubernetes API (kmock-based) in its own thread, a real etcd, and the operator
under KopfRunner — the pieces of the end-to-end CacheShard tests.

KUBECONFIG is pointed at a per-session file *before* anything imports ``kubernetes`` (kopf's and
our API logins read it); each emulator writes its own URL into that file when it starts.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

_KUBECONFIG = Path(tempfile.mkdtemp(prefix="kvshard-kubeconfig-")) / "config"
os.environ["KUBECONFIG"] = str(_KUBECONFIG)
atexit.register(shutil.rmtree, _KUBECONFIG.parent, ignore_errors=True)
# The handlers read these at import; short intervals keep the end-to-end tests quick.
for _key, _value in {"POD_SYNC_SECONDS": "0.5", "ETCD_TIMEOUT_SECONDS": "1", "RETRY_BACKOFF_SECONDS": "0.5",
                     "RETRY_BACKOFF_MAX": "2", "REBALANCE_CHECK_SECONDS": "1", "METRICS_PORT": "0",
                     "CATALOG_CHECK_SECONDS": "0.5"}.items():
    os.environ.setdefault(f"KVSHARD_OPERATOR_{_key}", _value)

from emulated import EmulatedCluster  # noqa: E402


@pytest.fixture
def cluster() -> Iterator[EmulatedCluster]:
    from kvshard_operator import kube

    kube._core_api.cache_clear()
    kube._batch_api.cache_clear()  # each test's API has its own port
    with EmulatedCluster() as c:
        yield c
    kube._core_api.cache_clear()
    kube._batch_api.cache_clear()


@pytest.fixture
def catalog_file(tmp_path: Path) -> Path:
    """Forty short items in four themes, as JSONL."""
    themes = {
        "space": ["rocket launch", "alien planet", "astronaut mission", "galaxy far away", "star cruiser",
                  "moon landing", "mars colony", "space station", "comet impact", "orbital flight"],
        "cooking": ["pasta recipe", "baking bread", "grilled steak", "vegan curry", "chocolate cake",
                    "sushi rolls", "soup of the day", "breakfast pancakes", "spicy tacos", "salad bowl"],
        "sports": ["football final", "tennis match", "marathon run", "basketball playoffs", "swimming race",
                   "cycling tour", "boxing night", "ski jump", "golf open", "rugby cup"],
        "music": ["jazz concert", "rock album", "piano sonata", "hip hop beats", "opera night",
                  "guitar solo", "symphony orchestra", "pop single", "drum and bass", "folk songs"],
    }
    lines = [json.dumps({"id": f"{theme}-{i}", "text": text})
             for theme, texts in themes.items() for i, text in enumerate(texts)]
    path = tmp_path / "items.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path
