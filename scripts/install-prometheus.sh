#!/usr/bin/env bash
# Install Debian's prometheus package (the Prometheus server and promtool), quietly, for
# the monitoring tests (tests/integration/test_monitoring.py). Needs root and apt-get; does nothing
# when both tools are already there. The package's service is never started: a
# policy-rc.d that refuses service starts is put in place for the install if the machine
# has none (container images usually do).
set -euo pipefail
if command -v promtool >/dev/null && command -v prometheus >/dev/null; then
    exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "promtool/prometheus missing: install Debian's prometheus package as root" \
         "(apt-get install --no-install-recommends prometheus)" >&2
    exit 1
fi
log=$(mktemp -t cgroupd-apt.XXXXXX)
policy=/usr/sbin/policy-rc.d
made_policy=
if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' > "$policy" && chmod 755 "$policy" && made_policy=1
fi
install() {
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        prometheus >>"$log" 2>&1
}
echo "installing Debian's prometheus package (promtool, Prometheus server)..." >&2
status=0
# The package lists may be there already; refresh them only if that is not enough.
install || { apt-get update -qq >>"$log" 2>&1 && install; } || status=$?
[ -n "$made_policy" ] && rm -f "$policy"
if [ "$status" != 0 ]; then
    echo "could not install prometheus (exit $status); apt said:" >&2
    tail -n 20 "$log" >&2
fi
rm -f "$log"
exit "$status"
