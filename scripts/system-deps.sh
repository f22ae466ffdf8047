#!/usr/bin/env bash
# Debian packages the test suite uses: man-db/groff (the generated manual page), chromium (the status page in a real browser), prometheus
# (for promtool: alert rules are checked and unit-tested), haproxy (the scale-out test puts the real
# HAProxy in front of three boxes with deploy/haproxy.cfg). Installs what is missing with apt-get
# (as root, or through sudo); the rest of the suite needs nothing from the system.
set -euo pipefail
missing=()
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
# HAProxy lives in /usr/sbin, which a non-root PATH may lack.
command -v haproxy >/dev/null 2>&1 || [ -x /usr/sbin/haproxy ] || missing+=(haproxy)
# man (or groff) renders the generated manual page in the CLI tests.
command -v man >/dev/null 2>&1 || command -v groff >/dev/null 2>&1 || missing+=(man-db groff-base)
[ ${#missing[@]} -eq 0 ] && exit 0
as_root=()
if [ "$(id -u)" != 0 ]; then
  if command -v sudo >/dev/null 2>&1; then as_root=(sudo); else
    echo "system-deps: missing ${missing[*]}; install them with apt-get (needs root)" >&2
    exit 1
  fi
fi
echo "system-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
"${as_root[@]}" apt-get update -qq
"${as_root[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" fonts-dejavu-core >/dev/null
