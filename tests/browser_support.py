"""Helpers for the browser tests: a real gateway (`voxgate serve`, tiny demo engine) in a child process, headless
Chromium, and reading what the page heard."""

from __future__ import annotations

import base64
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"
# The launch flags that work on our CI machines (shared/facts/ENVIRONMENT.md), plus autoplay without a gesture.
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--autoplay-policy=no-user-gesture-required",
]
OPUS_LOOKAHEAD = 312  # samples at 48 kHz before a decoded Opus stream reaches the encoded audio


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class GatewayProcess:
    """The real gateway with the tiny demo engine, on 127.0.0.1:port, in a child process (so it can be restarted)."""

    def __init__(self, port: int | None = None, log_path: Path | None = None):
        self.port = port or free_port()
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self.data_dir = tempfile.TemporaryDirectory(prefix="voxgate-browser-")  # kept across restarts

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 90.0) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115 (the child owns it)
        command = [sys.executable, "-m", "gateway.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
                   "--max-num-seqs", "8", "--shutdown-timeout", "1", "--data-dir", self.data_dir.name]
        self.proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the gateway exited with {self.proc.returncode} (log: {self.log_path})")
            try:
                with urllib.request.urlopen(self.url + "/readyz", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"the gateway was not ready within {timeout_s} s (log: {self.log_path})")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def launch_chromium(playwright):
    return playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)


def page_pcm(page, context_id: str) -> np.ndarray:
    """The decoded PCM the page captured for a turn (float32, 48 kHz)."""
    data = page.evaluate("(id) => window.__voxgateTest.pcmBase64(id)", context_id)
    return np.frombuffer(base64.b64decode(data), dtype=np.float32)


def distinct_colours(page, png: bytes) -> int:
    """How many different RGBA colours a PNG has (decoded by the browser: no imaging library needed here)."""
    return page.evaluate(
        """async (b64) => {
            const blob = await (await fetch("data:image/png;base64," + b64)).blob();
            const bitmap = await createImageBitmap(blob);
            const canvas = new OffscreenCanvas(bitmap.width, bitmap.height);
            const g = canvas.getContext("2d");
            g.drawImage(bitmap, 0, 0);
            const pixels = new Uint32Array(g.getImageData(0, 0, bitmap.width, bitmap.height).data.buffer);
            return new Set(pixels).size;
        }""",
        base64.b64encode(png).decode(),
    )
