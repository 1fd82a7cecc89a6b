"""Spark integration: read a consumer group as a stream, publish DataFrames to JetStream.

Install with ``pip install 'cgroupd[spark]'`` (pyspark >= 4.3, < 5, and pyarrow: the
versions ``pyproject.toml`` asks for; :data:`PYSPARK_MIN` is checked at
:func:`register`), then::

    import cgroupd.spark
    cgroupd.spark.register(spark)
    df = (spark.readStream.format("cgroupd")
          .option("servers", "nats://127.0.0.1:4222")
          .option("stream", "SENSORS").option("group", "analytics")
          .load())

The options (connection options as ``cgroupd join`` takes them, TLS included; the
source's and the sink's) are listed and checked in :mod:`cgroupd.spark.options`; see
:mod:`cgroupd.spark.source` and :mod:`cgroupd.spark.writer` for what they do.

Importing this package does not import pyspark; :func:`register` and the data source
class do.
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cgroupd.spark.source import CgroupdDataSource

__all__ = ["FORMAT", "CgroupdDataSource", "register", "worker_logging"]

FORMAT = "cgroupd"
#: The oldest pyspark the format runs on (Python data sources with admission control,
#: ``getDefaultReadLimit``; tested with 4.3.0), as in pyproject.toml's ``spark`` extra.
PYSPARK_MIN = (4, 3)


def _require_pyspark() -> None:
    try:
        import pyarrow  # noqa: F401
        import pyspark
    except ImportError as exc:
        raise ImportError(
            "cgroupd.spark needs pyspark and pyarrow: pip install 'cgroupd[spark]'") from exc
    found = tuple(int(p) for p in pyspark.__version__.split(".")[:2] if p.isdigit())
    if found < PYSPARK_MIN:
        raise ImportError(f"cgroupd.spark needs pyspark >= {PYSPARK_MIN[0]}.{PYSPARK_MIN[1]} "
                          f"(found {pyspark.__version__}): pip install 'cgroupd[spark]'")


#: Environment variable: the level of the lines cgroupd writes from Spark's Python
#: processes (``info`` by default; ``warning`` for errors and data loss only).
LOG_LEVEL_ENV = "CGROUPD_SPARK_LOG_LEVEL"


def worker_logging() -> None:
    """Show the ``cgroupd.spark`` log lines (lease taken and released, purges, data-loss
    decisions, what a write published) on the stderr of the Spark Python process that
    writes them: the driver's console for the source's driver side and the sinks'
    commits, an executor's ``stderr`` file for tasks. Spark's Python workers configure
    no logging, so a library's INFO lines would otherwise go nowhere. A process that
    configured logging or structlog itself keeps its own configuration."""
    logger = logging.getLogger("cgroupd.spark")
    if logger.handlers or logging.getLogger().handlers:
        return
    level = os.environ.get(LOG_LEVEL_ENV, "info").strip().upper()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(level if level in ("DEBUG", "INFO", "WARNING", "ERROR") else "INFO")
    logger.propagate = False


def _restorer() -> Callable[[str, str, bytes], Any]:
    """The function executors call to rebuild the readers, writers and tasks Spark
    pickles to them (:class:`Shipped`).

    Made inside a function so that cloudpickle (which Spark pickles with) sends it *by
    value*: an executor whose Python lacks cgroupd or pyarrow runs it, and it says which
    package that Python needs and where, instead of Spark's bare ``No module named
    'cgroupd'`` inside a ``PYTHON_DATA_SOURCE_ERROR``. It imports only the standard
    library until it has checked that, and the object's own state (pickled separately)
    is read only after.
    """

    def restore(module: str, qualname: str, state: bytes) -> Any:
        import importlib
        import pickle
        import socket
        import sys

        try:
            found: Any = importlib.import_module(module)
        except ImportError as exc:
            missing = exc.name or str(exc)
            raise ImportError(
                f"the Python of this Spark executor ({sys.executable} on "
                f"{socket.gethostname()}) cannot import {missing!r} ({exc}): the cgroupd "
                "format runs on every executor, so every node's Python needs cgroupd with "
                "its Spark extra, pyarrow included: pip install 'cgroupd[spark]' there, or "
                "point spark.pyspark.python (PYSPARK_PYTHON) at a Python that has it"
            ) from None
        for part in qualname.split("."):
            found = getattr(found, part)
        obj = found.__new__(found)
        obj.__dict__.update(pickle.loads(state))
        return obj

    return restore


_restore = _restorer()


class Shipped:
    """Base of what Spark pickles to executors: unpickled through :func:`_restorer`'s
    function, so a missing package is named (issue 30 row 5). Subclasses keep their
    state in ``__dict__`` (``__getstate__`` may drop driver-only parts)."""

    def __reduce__(self) -> tuple[Any, ...]:
        state = self.__getstate__() or {}
        return (_restore, (type(self).__module__, type(self).__qualname__,
                           pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL)))


def register(spark: Any) -> None:
    """Register the ``cgroupd`` format with a SparkSession."""
    _require_pyspark()
    from cgroupd.spark.source import CgroupdDataSource

    spark.dataSource.register(CgroupdDataSource)


def __getattr__(name: str) -> Any:
    if name == "CgroupdDataSource":
        _require_pyspark()
        from cgroupd.spark.source import CgroupdDataSource

        return CgroupdDataSource
    raise AttributeError(f"module 'cgroupd.spark' has no attribute {name!r}")
