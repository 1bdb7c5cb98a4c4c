"""Who holds the gateway's GIL, and what its event loop's thread is doing, under load: two py-spy recordings of a
process (py-spy reads the process's memory; `--nonblocking` never pauses it), summarised by thread.

A loop that lags while its thread uses little CPU is waiting for something: the GIL (held by the encode threads or
the engine's reader) or the OS. The `--gil` recording samples only the thread holding the GIL; the `--idle` one
samples every thread, busy or not. Side by side they say whether the loop's thread wanted to run but could not.
"""

from __future__ import annotations

import asyncio
import shutil
import sys
from collections import Counter
from pathlib import Path
from typing import Any

RATE = 100  # samples a second


def py_spy_binary() -> str | None:
    """py-spy on PATH, or beside this interpreter, or where bench/gpu_run.sh unpacks carried wheels."""
    for candidate in (shutil.which("py-spy"), str(Path(sys.executable).parent / "py-spy"), "/tmp/site/bin/py-spy"):
        if candidate and Path(candidate).exists():
            return candidate
    return None


async def record(pid: int, seconds: float, out_dir: Path, tag: str) -> dict[str, Any]:
    """`seconds` of `--gil` then `seconds` of `--idle` sampling of `pid`; their summary (raw stacks kept in
    out_dir as py_spy_<tag>_{gil,idle}.txt)."""
    binary = py_spy_binary()
    if binary is None:
        return {"error": "py-spy not found"}
    out_dir.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {}
    for mode in ("gil", "idle"):
        path = out_dir / f"py_spy_{tag}_{mode}.txt"
        proc = await asyncio.create_subprocess_exec(
            binary, "record", f"--{mode}", "--threads", "--nonblocking", "-r", str(RATE), "-d", str(int(seconds)),
            "--format", "raw", "-o", str(path), "-p", str(pid),
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
        _, err = await proc.communicate()
        if proc.returncode != 0 or not path.exists():
            return {"error": f"py-spy --{mode}: {err.decode(errors='replace').strip()[-300:]}"}
        summary[mode] = summarise(path.read_text())
        # --gil samples only while some thread holds the GIL: their rate is the GIL's busy share
        summary[mode]["share_of_time"] = round(summary[mode]["samples"] / (RATE * int(seconds)), 3)
    return summary


def summarise(raw: str, top: int = 8) -> dict[str, Any]:
    """py-spy's raw (collapsed) stacks with --threads -> samples by thread name, and each busy thread's most
    sampled innermost frames."""
    by_thread: Counter[str] = Counter()
    leaves: dict[str, Counter[str]] = {}
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        thread = _thread_name(frames[0])
        by_thread[thread] += int(count)
        leaf = " <- ".join(reversed(frames[1:][-2:]))  # the innermost frame, then its caller
        leaves.setdefault(thread, Counter())[leaf] += int(count)
    total = sum(by_thread.values())
    return {"samples": total,
            "share_by_thread": {t: round(n / total, 3) for t, n in by_thread.most_common()} if total else {},
            "top_frames": {t: [(f, n) for f, n in leaves[t].most_common(top)] for t, _ in by_thread.most_common(4)}}


def _thread_name(frame: str) -> str:
    """'thread (0x7f..): voxgate-offload_3' -> 'voxgate-offload' (a pool's threads summed)."""
    name = frame.partition(": ")[2] or frame
    return name.rsplit("_", 1)[0] if name.startswith(("voxgate-offload", "asyncio")) else name
