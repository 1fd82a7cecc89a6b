"""Issue 30 row 5: an executor whose Python lacks cgroupd or pyarrow is told which
package it needs, where. What Spark ships to executors is pickled with Spark's
cloudpickle here as Spark does, and read back in a Python that cannot import the
package (blocked by an import hook), like a node without it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("pyarrow")
pytest.importorskip("pyspark")

from pyspark import cloudpickle
from pyspark.sql.types import StructType

from cgroupd.spark.layout import PREFIXED, Layout, Mode
from cgroupd.spark.offsets import ReadRange
from cgroupd.spark.options import SinkOptions, SourceOptions
from cgroupd.spark.source import CgroupdBatchReader, CgroupdStreamReader, ReadTask
from cgroupd.spark.writer import CgroupdBatchWriter

LOAD = """
import pickle, sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == sys.argv[1]:
            raise ImportError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Block())
try:
    pickle.loads(open(sys.argv[2], "rb").read())
except ImportError as exc:
    print(f"{type(exc).__name__}: {exc}")
    print("chained:", exc.__cause__ is not None)
else:
    print("loaded")
"""


def _shipped() -> list[object]:
    source = SourceOptions.parse({"stream": "ORDERS", "group": "g"})
    layout = Layout("ORDERS-g", "ORDERS", "g", Mode.WORKQUEUE, PREFIXED, (0, 1), 2)
    return [CgroupdStreamReader(source), CgroupdBatchReader(source),
            ReadTask(layout, ReadRange(">", 0, 10), ((0, 0, 10),)),
            CgroupdBatchWriter(SinkOptions.parse({"subject": "out.x"}),
                               StructType.fromJson({"type": "struct", "fields": [
                                   {"name": "data", "type": "string", "nullable": True,
                                    "metadata": {}}]}))]


@pytest.mark.parametrize("package", ["cgroupd", "pyarrow"])
def test_a_missing_package_on_an_executor_is_named(package: str, tmp_path: Path) -> None:
    """Each object Spark sends to executors, read back where ``package`` cannot be
    imported, fails with an ImportError that names the package, the executor's Python
    and host, and ``pip install 'cgroupd[spark]'``, without a chained traceback."""
    for i, obj in enumerate(_shipped()):
        path = tmp_path / f"obj{i}.pickle"
        path.write_bytes(cloudpickle.dumps(obj))
        run = subprocess.run([sys.executable, "-c", LOAD, package, str(path)],
                             capture_output=True, text=True, timeout=60, cwd=tmp_path)
        assert run.returncode == 0, run.stderr
        out = run.stdout
        assert f"cannot import {package!r}" in out, (type(obj).__name__, out, run.stderr)
        assert "pip install 'cgroupd[spark]'" in out and sys.executable in out
        assert "chained: False" in out


def test_shipped_objects_read_back_whole(tmp_path: Path) -> None:
    """Where everything is installed the objects come back as they were sent."""
    for obj in _shipped():
        back = cloudpickle.loads(cloudpickle.dumps(obj))
        assert type(back) is type(obj)
        assert vars(back) == vars(obj)
