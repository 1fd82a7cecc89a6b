#!/usr/bin/env bash
# Install Debian's chromium package, quietly, for the console's browser tests
# (tests/console/test_console_browser.py drive it headless over the DevTools protocol).
# Needs root and apt-get; does nothing when a Chromium is already there.
set -euo pipefail
for name in chromium chromium-browser google-chrome google-chrome-stable; do
    if command -v "$name" >/dev/null; then
        exit 0
    fi
done
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "chromium missing: install Debian's chromium package as root" \
         "(apt-get install --no-install-recommends chromium)" >&2
    exit 1
fi
log=$(mktemp -t cgroupd-apt.XXXXXX)
install() {
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        chromium >>"$log" 2>&1
}
echo "installing Debian's chromium package (headless browser tests)..." >&2
status=0
# The package lists may be there already; refresh them only if that is not enough.
install || { apt-get update -qq >>"$log" 2>&1 && install; } || status=$?
if [ "$status" != 0 ]; then
    echo "could not install chromium (exit $status); apt said:" >&2
    tail -n 20 "$log" >&2
fi
rm -f "$log"
exit "$status"
