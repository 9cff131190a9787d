"""Where tokenwire caches what it builds: converted models (loader.py) and compiled kernels
(kernels/). Its own module so the kernels need not import the loader, which imports them."""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    env = os.environ.get("TOKENWIRE_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "tokenwire"
