"""Prometheus and promtool for the monitoring tests, from Debian's ``prometheus`` package.

``scripts/test.sh`` installs the package when it is missing (scripts/install-prometheus.sh,
as root with apt-get). A test that needs a tool calls :func:`require`: without it the test
fails under CI (``CI`` set: CI must have it) and is skipped elsewhere, saying how to get it.

:class:`PrometheusServer` runs a real Prometheus on a free loopback port with a config the
test writes (scrape targets, rule files, short intervals) and answers queries through the
HTTP API, the way Grafana and Alertmanager see it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.k8s_tools import in_ci
from tests.support.natsserver import find_free_port

HOW_TO_GET = ("install Debian's prometheus package: `apt-get install --no-install-recommends "
              "prometheus` as root, or `bash scripts/install-prometheus.sh` (scripts/test.sh "
              "does it when it may)")


def find(tool: str) -> Path | None:
    found = shutil.which(tool)
    return Path(found) if found else None


def require(tool: str) -> Path:
    """The path of ``tool`` (promtool or prometheus); fails in CI, skips elsewhere."""
    path = find(tool)
    if path is None:
        message = f"{tool} not found: {HOW_TO_GET}"
        if in_ci():
            pytest.fail(message)
        pytest.skip(message)
    return path


def promtool(*args: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([require("promtool"), *map(str, args)], capture_output=True,
                          text=True, timeout=120, cwd=cwd, check=False)


def check_rules(path: Path) -> str:
    """``promtool check rules``; AssertionError with its output when it refuses."""
    done = promtool("check", "rules", path)
    assert done.returncode == 0, f"promtool check rules {path}:\n{done.stdout}{done.stderr}"
    return done.stdout


class PrometheusServer:
    """A Prometheus process scraping ``targets`` with ``rule_files``; stop() always."""

    def __init__(self, workdir: Path, targets: list[str], rule_files: list[Path],
                 interval: str = "500ms") -> None:
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.port = find_free_port()
        config = {
            "global": {"scrape_interval": interval, "evaluation_interval": interval,
                       "scrape_timeout": interval},
            "rule_files": [str(p) for p in rule_files],
            "scrape_configs": [{"job_name": "cgroupd",
                                "static_configs": [{"targets": targets}]}],
        }
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self._log = open(workdir / "prometheus.log", "wb")  # closed in stop()
        self.proc = subprocess.Popen(
            [require("prometheus"), f"--config.file={workdir / 'prometheus.yml'}",
             f"--storage.tsdb.path={workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _get(self, path: str, **params: str) -> Any:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        with urllib.request.urlopen(self.url + path + query, timeout=5) as resp:
            return json.loads(resp.read())

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"prometheus exited {self.proc.returncode}:\n"
                                     f"{self.log()[-3000:]}")
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=1) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"prometheus not ready in {timeout}s:\n{self.log()}")
            time.sleep(0.1)

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's result vector; AssertionError naming the expression if
        Prometheus refuses it."""
        try:
            body = self._get("/api/v1/query", query=expr)
        except urllib.error.HTTPError as exc:
            raise AssertionError(f"{expr!r}: {exc.read().decode(errors='replace')}") from exc
        assert body["status"] == "success", f"{expr!r}: {body}"
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def alerts(self) -> list[dict[str, Any]]:
        alerts: list[dict[str, Any]] = self._get("/api/v1/alerts")["data"]["alerts"]
        return alerts

    def label_values(self, label: str, match: str) -> list[str]:
        values: list[str] = self._get(f"/api/v1/label/{label}/values",
                                      **{"match[]": match})["data"]
        return values

    def log(self) -> str:
        self._log.flush()
        return (self.workdir / "prometheus.log").read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._log.close()
