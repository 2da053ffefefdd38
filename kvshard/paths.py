"""Where kvshard keeps what survives a fresh clone: converted models, embeddings, downloads.

CI works in a fresh clone every time, so anything expensive to rebuild lives in a user cache
folder outside the repository: ``$KVSHARD_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/kvshard``,
else ``~/.cache/kvshard``.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """The user cache folder (created on first use)."""
    explicit = os.environ.get("KVSHARD_CACHE_DIR")
    if explicit:
        root = Path(explicit).expanduser()
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        root = (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "kvshard"
    root.mkdir(parents=True, exist_ok=True)
    return root


def models_dir() -> Path:
    """Converted Hugging Face model folders live here, one per model."""
    path = cache_dir() / "models"
    path.mkdir(parents=True, exist_ok=True)
    return path
