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

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cgroupd.spark.source import CgroupdDataSource

__all__ = ["FORMAT", "CgroupdDataSource", "register"]

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
