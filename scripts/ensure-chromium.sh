#!/usr/bin/env bash
# Makes sure Debian's chromium is at /usr/bin/chromium: tests/test_chat_page.py drives it headless
# over the DevTools protocol (no npm package, no downloaded browser). Installs it with apt-get when
# run as root; otherwise says how, and exits non-zero (`make test` goes on; that test is skipped).
set -euo pipefail
if [ -x /usr/bin/chromium ]; then exit 0; fi
if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
  echo "chromium not found: installing Debian's chromium with apt-get (for the chat page test)" >&2
  apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null
  [ -x /usr/bin/chromium ] && exit 0
  echo "apt-get finished but /usr/bin/chromium is still missing" >&2
  exit 1
fi
echo "chromium is not installed at /usr/bin/chromium and this user cannot install it." >&2
echo "Install it (Debian/Ubuntu: sudo apt-get install chromium) to run the chat page test; it is skipped meanwhile." >&2
exit 1
