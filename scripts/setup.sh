#!/usr/bin/env bash
# Sets up voxgate on a fresh Debian machine (as root, or with sudo): system libraries, then a virtualenv in .venv.
#   scripts/setup.sh          runtime only
#   scripts/setup.sh test     runtime + test tools (the official voxcpm oracle, Chromium for browser tests)
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-run}
SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"

apt_pkgs="libopus0 libsndfile1"
[ "$mode" = test ] && apt_pkgs="$apt_pkgs chromium"
missing=""
for p in $apt_pkgs; do dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"; done
if [ -n "$missing" ]; then
  echo "==> installing system packages:$missing"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq $missing >/dev/null
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "==> creating .venv"
  $PY -m venv .venv
fi
pip=".venv/bin/python -m pip"
$pip install -q --upgrade pip
# torch==2.13.0 is the CPU build on our machines; on a GPU host install your CUDA torch first, it is kept.
.venv/bin/python -c "import torch" 2>/dev/null || $pip install -q "torch==2.13.0" || $pip install -q torch
if [ "$mode" = test ]; then
  echo "==> installing voxgate with test extras"
  $pip install -q -e ".[test]" "numpy<2.4"
  # The official package is the test oracle; --no-deps because its pins would replace our torch.
  $pip install -q --no-deps "voxcpm==2.0.3"
else
  echo "==> installing voxgate"
  $pip install -q -e .
fi
echo "==> ready"
