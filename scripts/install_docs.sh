#!/usr/bin/env bash
# Install the Debian documentation packages the default long-document set draws on, where apt exists.
# Without apt (or without root) the default set is built from the CPython standard library alone.
set -uo pipefail
PKGS="linux-doc-6.1 python3.11-doc debian-policy gnu-standards"
if ! command -v apt-get >/dev/null 2>&1; then
  echo "apt-get not found: the default documents will come from the CPython standard library only"; exit 0
fi
SUDO=""
if [ "$(id -u)" != "0" ]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then SUDO="sudo -n"; else
    echo "not root and no passwordless sudo: skipping Debian doc packages ($PKGS)"; exit 0; fi
fi
AVAILABLE=""
for p in $PKGS; do
  if dpkg -s "$p" >/dev/null 2>&1; then continue; fi
  AVAILABLE="$AVAILABLE $p"
done
[ -z "$AVAILABLE" ] && { echo "Debian doc packages already installed"; exit 0; }
$SUDO apt-get update -qq >/dev/null 2>&1 || true
for p in $AVAILABLE; do
  if $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$p" >/dev/null 2>&1; then
    echo "installed $p"
  else
    echo "could not install $p (not in this machine's apt sources): skipped"
  fi
done
exit 0
