#!/usr/bin/env bash
# Sets up voxgate on a fresh Debian machine (as root, or with sudo): system libraries, then a virtualenv in .venv.
#   scripts/setup.sh          runtime only
#   scripts/setup.sh test     runtime + test tools (the official voxcpm oracle, Chromium for browser tests, HAProxy)
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-run}
SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"

# gcc + python3-dev build gateway/_opus_frames.c (Opus frames encoded without the GIL; optional: without a compiler
# the gateway encodes frame by frame through opuslib)
apt_pkgs="libopus0 libsndfile1 gcc python3-dev"
# test: chromium for the browser tests, haproxy and redis-server for the cluster and store tests (each test starts its own)
[ "$mode" = test ] && apt_pkgs="$apt_pkgs chromium haproxy redis-server"
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
  # Pipecat's ElevenLabs service is a real third-party client for the compat tests. Its full dependency set would
  # downgrade soxr/soundfile and pull onnxruntime, so install it bare plus what its ElevenLabs service imports.
  $pip install -q --no-deps "pipecat-ai==1.14.0" "loguru==0.7.3" "wait_for2==0.4.1" "docstring_parser==0.18.0" \
    "Markdown==3.11.3" "python-dotenv==1.2.4" "aiofiles==25.1.0" "loudness==0.2.0" "sentencex==1.0.32" \
    "resampy==0.4.3" "num2words==0.5.14" "pillow==13.0.0"
  # The official SDKs and LiveKit Agents' TTS plugins are real clients for the compat tests (the SDKs' message models
  # also judge every message the compat sockets send). protobuf stays below 7, as Pipecat requires.
  $pip install -q "elevenlabs==2.78.0" "cartesia==4.2.0" "deepgram-sdk==7.17.0" "livekit-agents==1.8.9" \
    "livekit-plugins-elevenlabs==1.8.9" "livekit-plugins-cartesia==1.8.9" "livekit-plugins-deepgram==1.8.9" \
    "livekit-plugins-openai==1.8.9" "protobuf==6.33.6"
else
  echo "==> installing voxgate"
  $pip install -q -e .
fi
echo "==> ready"
