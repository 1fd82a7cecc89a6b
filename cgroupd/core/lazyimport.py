"""Importing a library as if one of its optional extras were not installed.

Some libraries import an optional extra at import time only for a feature a member may
never use (nats-py: aiohttp for websocket servers; structlog: rich for console
tracebacks), and each costs megabytes resident in every instance (issue 15's RSS target).
"""

from __future__ import annotations

import importlib
import sys


def import_without(module: str, extra: str) -> None:
    """Import ``module`` while importing ``extra`` raises ImportError; a process that has
    loaded either already keeps what it loaded. Later imports of ``extra`` work again."""
    if module in sys.modules or extra in sys.modules:
        return
    sys.modules[extra] = None  # type: ignore[assignment]  # its import raises ImportError
    try:
        importlib.import_module(module)
    finally:
        if extra in sys.modules and sys.modules[extra] is None:
            del sys.modules[extra]
