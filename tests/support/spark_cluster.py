"""A Spark standalone cluster on this machine, for the cluster test and the benchmark.

A master and ``workers`` workers (``cores`` cores, ``memory`` each), started with
pyspark's own ``spark-class`` and bound to 127.0.0.1, every process ended by its pid
(and its descendants: a worker's executors and their Python workers) on ``stop()``.
Only one SparkContext may live in a process, and the Spark tests keep a local one, so a
query on the cluster runs in a driver process of its own: :func:`drive` (``python -m
tests.support.spark_cluster``), which prints one JSON line per finished batch and one
at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
#: JVM options for a quick start on a small, busy machine (tests): the C1 compiler only,
#: the serial collector.
QUICK_JVM = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"


def spark_home() -> Path:
    import pyspark

    return Path(pyspark.__file__).resolve().parent


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (from /proc), parents first."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop(0)
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def _kill(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


class StandaloneCluster:
    """``with StandaloneCluster(tmp) as cluster: ... cluster.url ...``"""

    def __init__(self, workdir: Path, workers: int = 2, cores: int = 1,
                 memory: str = "512m", quick_jvm: bool = True) -> None:
        self.workdir = workdir
        #: JVMs that start fast rather than run fast (C1 only, serial GC): tests.
        self.java_opts = QUICK_JVM if quick_jvm else ""
        self.workers = workers
        self.cores = cores
        self.memory = memory
        self.port = free_port()
        self.ui_port = free_port()
        self.master: subprocess.Popen[bytes] | None = None
        self.worker_procs: list[subprocess.Popen[bytes]] = []

    @property
    def url(self) -> str:
        return f"spark://127.0.0.1:{self.port}"

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(SPARK_HOME=str(spark_home()), SPARK_LOCAL_IP="127.0.0.1",
                   SPARK_DAEMON_MEMORY="256m", PYSPARK_PYTHON=sys.executable,
                   SPARK_NO_DAEMONIZE="1", SPARK_DAEMON_JAVA_OPTS=self.java_opts)
        return env

    def _start(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        log = open(self.workdir / f"{name}.log", "wb")
        try:
            return subprocess.Popen(
                [str(spark_home() / "bin" / "spark-class"), *args], env=self._env(),
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                cwd=self.workdir)
        finally:
            log.close()

    def start(self, timeout: float = 300.0) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.master = self._start(
            "master", "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
            "--port", str(self.port), "--webui-port", str(self.ui_port))
        for i in range(self.workers):
            work = self.workdir / f"worker-{i}"
            work.mkdir(exist_ok=True)
            self.worker_procs.append(self._start(
                f"worker-{i}", "org.apache.spark.deploy.worker.Worker", "--host",
                "127.0.0.1", "--cores", str(self.cores), "--memory", self.memory,
                "--webui-port", str(free_port()), "--work-dir", str(work), self.url))
        deadline = time.monotonic() + timeout
        while self.alive_workers() < self.workers:
            for proc in [self.master, *self.worker_procs]:
                if proc.poll() is not None:
                    raise RuntimeError(f"a Spark daemon exited: {self.logs()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"workers did not register in {timeout}s: {self.logs()}")
            time.sleep(0.25)

    def state(self) -> dict[str, Any]:
        """The master's own view (its web UI's JSON)."""
        url = f"http://127.0.0.1:{self.ui_port}/json/"
        with urllib.request.urlopen(url, timeout=2) as answer:
            return json.loads(answer.read())  # type: ignore[no-any-return]

    def alive_workers(self) -> int:
        try:
            return int(self.state().get("aliveworkers", 0))
        except (OSError, ValueError):
            return 0

    def kill_worker(self, i: int) -> list[int]:
        """SIGKILL worker ``i`` with its executor and the executor's Python workers, as
        a node that dies would; returns the pids killed."""
        pids = descendants(self.worker_procs[i].pid)
        _kill(list(reversed(pids)), signal.SIGKILL)
        self.worker_procs[i].wait(timeout=30)
        return pids

    def logs(self, tail: int = 3000) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-tail:]}"
                         for p in sorted(self.workdir.glob("*.log")))

    def stop(self) -> None:
        """End every process started (and its descendants), by pid."""
        procs = [p for p in [*self.worker_procs, self.master] if p is not None]
        pids = [pid for p in procs for pid in descendants(p.pid) if p.poll() is None]
        _kill(pids, signal.SIGTERM)
        deadline = time.monotonic() + 15
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        left = [pid for pid in pids if Path(f"/proc/{pid}").exists()]
        _kill(left, signal.SIGKILL)
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)

    def __enter__(self) -> StandaloneCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


def cluster_session(master: str, tmp: Path, app: str = "cgroupd-cluster",
                    quick_jvm: bool = True) -> Any:
    """A SparkSession on ``master`` whose executors use this Python (1 core, 512 MB
    each, at most 2 cores in all) and whose driver binds to 127.0.0.1."""
    from pyspark.sql import SparkSession

    import cgroupd.spark

    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    spark = (SparkSession.builder.master(master).appName(app)
             .config("spark.driver.host", "127.0.0.1")
             .config("spark.driver.bindAddress", "127.0.0.1")
             .config("spark.driver.memory", "512m")
             .config("spark.executor.memory", "512m")
             .config("spark.executor.cores", "1")
             .config("spark.cores.max", "2")
             .config("spark.pyspark.python", sys.executable)
             .config("spark.ui.enabled", "false")
             .config("spark.sql.shuffle.partitions", "2")
             .config("spark.local.dir", str(tmp / "spark-local"))
             .config("spark.sql.warehouse.dir", str(tmp / "warehouse"))
             .config("spark.driver.extraJavaOptions", QUICK_JVM if quick_jvm else "")
             .config("spark.executor.extraJavaOptions", QUICK_JVM if quick_jvm else "")
             .getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    cgroupd.spark.register(spark)
    return spark


def drive(args: argparse.Namespace) -> int:
    """Stream group ``g`` of ``--stream`` into the cgroupd sink (subject ``out.<key>``)
    with at most ``--per-batch`` messages a batch, AvailableNow; a JSON line per batch."""
    from pyspark.sql import functions as F

    tmp = Path(args.tmp)
    spark = cluster_session(args.master, tmp)
    print(json.dumps({"started": True, "app": spark.sparkContext.applicationId}),
          flush=True)
    rows = (spark.readStream.format("cgroupd").option("servers", args.servers)
            .option("stream", args.stream).option("group", "g")
            .option("maxOffsetsPerTrigger", str(args.per_batch)).load()
            .select(F.concat(F.lit("out."), F.col("key")).alias("subject"), "data"))
    query = (rows.writeStream.format("cgroupd").option("servers", args.servers)
             .option("stream", "OUT").option("checkpointLocation", str(tmp / "checkpoint"))
             .trigger(availableNow=True).start())
    shown = 0
    while query.isActive:
        progress = query.recentProgress
        for p in progress[shown:]:
            print(json.dumps({"batch": p["batchId"], "rows": p["numInputRows"]}),
                  flush=True)
        shown = len(progress)
        time.sleep(0.1)
    error = query.exception()
    rows_read = sum(p["numInputRows"] for p in query.recentProgress)
    print(json.dumps({"done": True, "rows": rows_read,
                      "error": str(error) if error else None}), flush=True)
    spark.stop()
    return 0 if error is None else 1


def main() -> int:
    parser = argparse.ArgumentParser(description="drive a query on a standalone cluster")
    parser.add_argument("--master", required=True)
    parser.add_argument("--servers", required=True)
    parser.add_argument("--stream", default="ORDERS")
    parser.add_argument("--per-batch", type=int, default=2500)
    parser.add_argument("--tmp", required=True)
    return drive(parser.parse_args())


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
