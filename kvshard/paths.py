"""Where kvshard keeps what survives a fresh clone: converted models, embeddings, downloads.

CI works in a fresh clone every time, so anything expensive to rebuild lives in a user cache
folder outside the repository: ``$KVSHARD_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/kvshard``,
else ``~/.cache/kvshard``.
"""

from __future__ import annotations

from pathlib import Path

from kvshard.settings import environment


def cache_dir() -> Path:
    """The user cache folder (created on first use)."""
    env = environment()
    if env.kvshard_cache_dir is not None:
        root = env.kvshard_cache_dir.expanduser()
    else:
        xdg = env.xdg_cache_home
        root = (xdg.expanduser() if xdg is not None else Path.home() / ".cache") / "kvshard"
    root.mkdir(parents=True, exist_ok=True)
    return root


def models_dir() -> Path:
    """Converted Hugging Face model folders live here, one per model."""
    path = cache_dir() / "models"
    path.mkdir(parents=True, exist_ok=True)
    return path
