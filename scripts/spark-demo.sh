#!/usr/bin/env bash
# Set up a virtualenv (.venv) with cgroupd's Spark extra and an embedded nats-server, then
# run the Spark example (examples/spark/sensors.py): two consumer groups read by Spark
# (aggregates to Parquet, alerts back to NATS) and an archive query that the example kills
# with SIGKILL mid-way, restarts from its checkpoint, and checks for every reading exactly
# once. Needs Java 17 on PATH. Extra arguments go to the example (e.g. --sensors 20).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${CGROUPD_VENV:-.venv}
command -v java >/dev/null || { echo "spark-demo: Java 17 is needed on PATH (e.g. apt-get install openjdk-17-jre-headless)" >&2; exit 2; }
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -e '.[spark,embedded]'
export PATH="$PWD/$VENV/bin:$PATH"
exec "$VENV/bin/python" examples/spark/sensors.py "$@"
