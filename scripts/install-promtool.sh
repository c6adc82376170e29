#!/usr/bin/env bash
# Puts promtool and prometheus at .tools/bin/ (idempotent), for the observability tests (the
# linter, and a real Prometheus that discovers `meshkeeper up`'s agents through HTTP SD).
# Both come from Debian's `prometheus` package, extracted rather than installed: no service
# starts, nothing outside the repo changes, and no root is needed once apt lists exist.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=.tools
bin="$dest/bin/promtool"
if [ -x "$bin" ] && "$bin" --version >/dev/null 2>&1 && [ -x "$dest/bin/prometheus" ]; then
  exit 0
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# apt-get download needs package lists; fetch them once if this machine has none.
if ! (cd "$work" && apt-get download -q prometheus >/dev/null 2>&1); then
  apt-get update -q >/dev/null
  (cd "$work" && apt-get download -q prometheus)
fi
dpkg-deb -x "$work"/prometheus_*.deb "$work/root"
mkdir -p "$dest/bin"
install -m 0755 "$work/root/usr/bin/promtool" "$bin"
install -m 0755 "$work/root/usr/bin/prometheus" "$dest/bin/prometheus"
"$bin" --version | head -n 1
