#!/usr/bin/env bash
# Makes sure redis-server is on PATH: the tests start a real one on a free port.
set -euo pipefail
if command -v redis-server >/dev/null 2>&1; then exit 0; fi
if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
  echo "redis-server not found: installing it with apt-get" >&2
  apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
  exit 0
fi
echo "redis-server is not installed and this user cannot install it." >&2
echo "Install it (Debian/Ubuntu: sudo apt-get install redis-server; macOS: brew install redis) and run 'make test' again." >&2
exit 1
