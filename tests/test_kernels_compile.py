"""Every Triton kernel of engine/ compiles for the H200 (sm_90), with no GPU.

The rest of the CPU suite runs the kernels in Triton's interpreter, which skips the compiler frontend: a LoRA kernel
once passed every interpreter test and then failed on the H200 with "Mismatched type for b between then block and
else block". tests/kernel_compile_cases.py runs the real launchers on small CPU tensors of the released models'
widths (bf16 and fp32) and compiles what each launch would compile for sm_90. It needs TRITON_INTERPRET=0, which this
session cannot have (conftest.py turns the interpreter on before triton is imported), hence one subprocess per
dtype set: the default suite compiles what the GPU runs by default (bf16 stacks, fp32 VAE); the other half (fp32
stacks, the bf16 VAE) is `heavy` (CI runs it, `make test` does not).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

CASES = Path(__file__).with_name("kernel_compile_cases.py")


@pytest.fixture(scope="module", params=["serving", pytest.param("other", marks=pytest.mark.heavy)])
def report(request, tmp_path_factory) -> dict:
    """The JSON report of one run of kernel_compile_cases.py on one dtype set (a fresh Triton cache, so everything
    really compiles)."""
    env = dict(os.environ, TRITON_INTERPRET="0", OMP_NUM_THREADS="1",
               TRITON_CACHE_DIR=str(tmp_path_factory.mktemp("triton-cache")))
    done = subprocess.run([sys.executable, str(CASES), request.param], env=env, capture_output=True, text=True,
                          timeout=240)
    if done.returncode != 0:
        pytest.fail(f"kernel_compile_cases.py exited with {done.returncode}:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout)


def test_every_kernel_has_a_compile_case(report):
    launched = {r["kernel"] for r in report["results"]}
    assert report["kernels"], "found no @triton.jit function in engine/"
    assert launched <= set(report["kernels"])
    assert not report["uncovered"], (
        f"kernels with no compile case (launch them in tests/kernel_compile_cases.py): {report['uncovered']}")


def test_every_kernel_compiles_for_sm90(report):
    failures = [f"{r['kernel']} ({r['case']}; constexprs {r['constexprs']}):\n{r['error']}"
                for r in report["results"] if r["error"] is not None]
    assert not failures, (f"{len(failures)} of {len(report['results'])} compiles failed for sm_90:\n\n"
                          + "\n\n".join(failures))
