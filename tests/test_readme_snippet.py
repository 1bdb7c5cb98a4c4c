"""The README's "From Python" snippet runs exactly as written, against the demo model, both saved as a script (no
main guard) and piped into `python -`; the demo model's audio is honest noise at a comfortable level."""

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

pytestmark = pytest.mark.timeout(180)
ROOT = Path(__file__).resolve().parents[1]


def readme_snippet() -> str:
    """The first ```python block after the README's "From Python" heading."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("### From Python"):]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "the README's From Python section has no python block"
    return match.group(1)


@pytest.fixture(scope="module")
def demo_cache(tmp_path_factory) -> Path:
    """One demo model for both runs, written by the first (what a new user's first run does)."""
    return tmp_path_factory.mktemp("voxgate-cache")


@pytest.mark.parametrize("how", ["script", "stdin"])
def test_readme_python_snippet_runs_as_written(how, demo_cache, tmp_path):
    code = readme_snippet()
    assert "__main__" not in code
    script = tmp_path / "first.py"
    script.write_text(code)
    cmd = [sys.executable, str(script)] if how == "script" else [sys.executable, "-"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VOXGATE_CACHE": str(demo_cache), "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=150,
                          input=None if how == "script" else code)
    assert done.returncode == 0, done.stderr
    for noise in ("Traceback", "leaked", "Warning"):
        assert noise not in done.stderr, done.stderr
    lines = done.stdout.splitlines()
    assert lines and all(re.fullmatch(r"\d+ samples at 48000 Hz", line) for line in lines), done.stdout

    audio, rate = sf.read(tmp_path / "hello.wav", dtype="float32")
    assert rate == 48000 and audio.ndim == 1 and len(audio) % 7680 == 0 and len(audio) > 0
    rms_dbfs = 20 * np.log10(np.sqrt(np.mean(audio.astype(np.float64) ** 2)))
    assert -26 < rms_dbfs < -14, f"demo audio at {rms_dbfs:.1f} dBFS: not a comfortable level"
    assert np.abs(audio).max() < 0.9  # no sample near clipping
    assert np.abs(audio.mean()) < 0.05  # noise, not an offset
