"""For every test (core and plugins): measured verification curves (specplug.pricing.cache) go to a
folder of this run, removed after it, never the user's ~/.cache, so no test reads a curve another run left."""
from __future__ import annotations

import os
import shutil
import tempfile

_made: list[str] = []


def pytest_configure(config):
    if "SPECPLUG_CACHE_DIR" not in os.environ:
        _made.append(tempfile.mkdtemp(prefix="specplug-test-cache-"))
        os.environ["SPECPLUG_CACHE_DIR"] = _made[-1]


def pytest_unconfigure(config):
    for d in _made:
        shutil.rmtree(d, ignore_errors=True)
        os.environ.pop("SPECPLUG_CACHE_DIR", None)
