#!/usr/bin/env bash
# Native libraries the Mooncake client and master load even over TCP (libibverbs and libnl),
# for machines without Debian's libibverbs1: extracted from the Debian packages into
# <venv>/lib/mooncake-deps, without root (tiers/chunks/mooncake_client.py and the tests load them
# from there). Idempotent; does nothing when the system already has libibverbs.so.1.
set -euo pipefail
venv="$1"
target="$venv/lib/mooncake-deps"
if ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1 '; then
    exit 0
fi
if [ -e "$target/libibverbs.so.1" ]; then
    exit 0
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
packages=(libibverbs1 libnl-3-200 libnl-route-3-200)
if ! (cd "$work" && apt-get download -qq "${packages[@]}" 2>/dev/null); then
    apt-get update -qq  # package lists missing (a bare image)
    (cd "$work" && apt-get download -qq "${packages[@]}")
fi
for deb in "$work"/*.deb; do
    dpkg -x "$deb" "$work/root"
done
mkdir -p "$target"
find "$work/root" -name 'lib*.so*' -exec cp -P {} "$target/" \;
echo "Mooncake native dependencies in $target"
