"""Spark integration: read a consumer group as a stream, publish DataFrames to JetStream.

Install with ``pip install 'cgroupd[spark]'`` (pyspark >= 4.2, pyarrow), then::

    import cgroupd.spark
    cgroupd.spark.register(spark)
    df = (spark.readStream.format("cgroupd")
          .option("servers", "nats://127.0.0.1:4222")
          .option("stream", "SENSORS").option("group", "analytics")
          .load())

Source options: ``servers`` (comma-separated), ``creds`` | ``token`` | ``user`` +
``password``, ``stream``, ``group``, ``member`` (read only that member's partitions),
``startingOffsets`` (``earliest`` | ``latest`` | ``{"<partition>": <sequence>}``),
``maxOffsetsPerTrigger``, ``minPartitions``, ``fetchBatch``,
``leaseInactiveThreshold`` and ``leaseWaitTimeout`` (seconds). Sink options: the same
connection options, ``subject``, ``stream``, ``idPrefix``, ``maxPending``,
``publishTimeout``. See :mod:`cgroupd.spark.source` and :mod:`cgroupd.spark.writer`.

Importing this package does not import pyspark; :func:`register` and the data source
class do.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cgroupd.spark.source import CgroupdDataSource

__all__ = ["FORMAT", "CgroupdDataSource", "register"]

FORMAT = "cgroupd"


def _require_pyspark() -> None:
    try:
        import pyarrow  # noqa: F401
        import pyspark  # noqa: F401
    except ImportError as exc:
        raise ImportError(
            "cgroupd.spark needs pyspark and pyarrow: pip install 'cgroupd[spark]'") from exc


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
