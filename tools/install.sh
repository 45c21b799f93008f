#!/usr/bin/env bash
# Installs OctoSplat and everything it needs into ./.venv (created if missing).
# Usage: bash tools/install.sh        (idempotent; safe to run again)
set -euo pipefail
cd "$(dirname "$0")/.."

# open3d-cpu links against libusb at import time; Debian ships it as libusb-1.0-0.
if ! ldconfig -p 2>/dev/null | grep -q 'libusb-1.0.so.0'; then
    if command -v apt-get >/dev/null 2>&1; then
        SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
        $SUDO apt-get update -qq
        DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq libusb-1.0-0 >/dev/null
    else
        echo "warning: libusb-1.0 not found; open3d (PLY voxel downsampling) will be unavailable" >&2
    fi
fi

# The viewer's browser tests drive Debian's chromium headless (Playwright never downloads a browser here).
if ! command -v chromium >/dev/null 2>&1; then
    if command -v apt-get >/dev/null 2>&1; then
        SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
        { $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null; } \
            || echo "warning: chromium could not be installed; the viewer's browser tests will skip" >&2
    else
        echo "warning: chromium not found; the viewer's browser tests will skip" >&2
    fi
fi

PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch==2.13.0 is pinned in pyproject.toml: pip takes the CPU wheel from the local disk.
.venv/bin/python -m pip install -q -e '.[test]'
