#!/usr/bin/env bash
# Checks the files under deploy/ with the tools that run them: the Prometheus alert rules
# (`promtool check rules` and the rule unit tests), deploy/haproxy.cfg (`haproxy -c`) and the systemd units (`systemd-analyze
# verify`, which prints its complaints but exits 0, so any output fails here). The Grafana
# dashboard's metric names are checked against a running gateway by the Rust test
# `deploy::dashboard_and_alert_rules_name_only_exported_metrics`.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v promtool >/dev/null || { echo "check-deploy: promtool not found (apt-get install prometheus)"; exit 1; }
promtool check rules deploy/prometheus/alerts.yml
(cd deploy/prometheus && promtool test rules alerts.test.yml)
# HAProxy's config as shipped, with the environment it reads (the scale-out Rust test runs it).
haproxy=$(command -v haproxy || echo /usr/sbin/haproxy)
[ -x "$haproxy" ] || { echo "check-deploy: haproxy not found (apt-get install haproxy)"; exit 1; }
HEADROOM_FRONT=127.0.0.1:8000 HEADROOM_STATS=/tmp/headroom-check.sock \
  BOX1=127.0.0.1:9001 BOX2=127.0.0.1:9002 BOX3=127.0.0.1:9003 AGENT1=9101 AGENT2=9102 AGENT3=9103 \
  "$haproxy" -c -q -f deploy/haproxy.cfg
echo "deploy/haproxy.cfg: valid"
if command -v systemd-analyze >/dev/null; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  for unit in deploy/systemd/*.service; do
    # verify insists that ExecStart's binary exists: point it at one that does, change nothing else.
    sed 's|^ExecStart=/usr/local/bin/headroom |ExecStart=/bin/true |' "$unit" >"$tmp/$(basename "$unit")"
  done
  out=$(systemd-analyze verify "$tmp"/*.service 2>&1) || { echo "$out"; exit 1; }
  if [ -n "$out" ]; then echo "systemd-analyze verify:"; echo "$out"; exit 1; fi
  echo "systemd units: $(ls deploy/systemd/*.service | wc -l) verified"
else
  echo "systemd-analyze not available: systemd units not verified"
fi
