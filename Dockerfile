# syntax=docker/dockerfile:1
#
# cgroupd: one member instance per container. Configured only by CGROUPD_* environment
# variables (see `cgroupd join --help`); no secrets are baked in: NATS credentials and TLS
# files are mounted at run time and named by CGROUPD_CREDS / CGROUPD_TLS_* (the Helm chart
# and deploy/ do this). Kubernetes: docs/kubernetes.md.
#
#   docker build -t cgroupd:0.1.0 .
#   docker run --rm -e CGROUPD_SERVER=nats://nats:4222 -e CGROUPD_STREAM=ORDERS \
#       -e CGROUPD_GROUP=workers -e CGROUPD_MEMBER=m0 \
#       -e CGROUPD_WEBHOOK=http://handler:8000/ cgroupd:0.1.0
#
# Handler functions instead of a webhook: build FROM this image, COPY your package into
# /app (the working directory, which `cgroupd join --handler` imports from) and set
# CGROUPD_HANDLER=yourpkg.module:function.
#
# CI has no Docker engine: tests/k8s/test_k8s.py lints this file with hadolint and replays the
# build stage (its COPY, ENV and RUN steps) in a clean virtualenv, then runs `cgroupd --help`.

ARG PYTHON_IMAGE=python:3.12-slim

# -- build: the package and its runtime dependencies in a virtualenv (no dev extras) ------
FROM ${PYTHON_IMAGE} AS build
ENV VENV=/opt/cgroupd \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY cgroupd/ ./cgroupd/
# nkeys (with PyNaCl) signs --creds/--nkey connections: the import check fails the build
# if a dependency change ever drops it (nats-py imports it lazily, only when connecting).
RUN python -m venv "$VENV" \
    && "$VENV/bin/pip" install . \
    && "$VENV/bin/python" -c "import nkeys, nacl.signing" \
    && "$VENV/bin/cgroupd" --help > /dev/null

# -- runtime: the virtualenv only, as an unprivileged user --------------------------------
FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="cgroupd" \
      org.opencontainers.image.description="Partitioned consumer groups for NATS JetStream" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid 10001 cgroupd \
    && useradd --system --no-log-init --uid 10001 --gid 10001 --no-create-home --home-dir /app \
       --shell /usr/sbin/nologin cgroupd
COPY --from=build /opt/cgroupd /opt/cgroupd
# Bytecode was compiled at install time: nothing is written at run time, so the container
# runs with a read-only root filesystem.
ENV PATH=/opt/cgroupd/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    CGROUPD_METRICS_PORT=8080
WORKDIR /app
USER 10001:10001
# /metrics, /healthz, /readyz
EXPOSE 8080
ENTRYPOINT ["cgroupd"]
CMD ["join"]
