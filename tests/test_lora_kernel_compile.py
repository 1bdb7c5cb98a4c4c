"""Every LoRA kernel variant (engine.model.lora_triton.VARIANTS) compiles for the H200 (sm_90) without spilling.

tests/test_kernels_compile.py compiles what the launchers run by default (`fused=True/False`); bench/lora_bench.py
--step runs every variant on the GPU, so each must compile there too: the PDL launches, the wider expand tiles, 8
warps, 4 pipeline stages. This runs lora_add_ with each variant at VoxCPM2's q|k|v and o (LM and LocDiT, bf16, one
sequence and 64) through tests/kernel_compile_cases.py's recorder, compiles each distinct launch for sm_90, and reads
each cubin's registers, local memory (spills) and stack with the cuobjdump Triton ships. Like the other compile test it
needs TRITON_INTERPRET=0, hence a subprocess running this file as a script.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAX_SHARED = 227 * 1024  # an H100/H200 block's shared memory limit
SHAPES = {"lm": (2048, (2048, 256, 256), 1), "dit": (1024, (2048, 256, 256), 11)}  # K, q|k|v outs, rows per entry


def resources(cubin: bytes) -> dict[str, int] | None:
    """{REG, STACK, SHARED, LOCAL} of a cubin from `cuobjdump -res-usage` (None without cuobjdump)."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    line = next(ln for ln in text.splitlines() if "REG:" in ln)
    fields = dict(item.split(":") for item in line.split() if ":" in item)
    return {key: int(fields[key]) for key in ("REG", "STACK", "SHARED", "LOCAL")}


def report() -> dict:
    """Compile every variant's launches; the JSON the test reads."""
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    import kernel_compile_cases as cases
    import torch
    import triton
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    from engine.model import lora_triton

    recorder = cases.Recorder()
    JITFunction.run = lambda fn, *a, grid, warmup, **kw: recorder.run(fn, *a, grid=grid, warmup=warmup, **kw)
    dtype, slots, rank = torch.bfloat16, 33, 32
    with torch.no_grad():
        for name in lora_triton.VARIANTS:
            for stack, (k, outs, per) in SHAPES.items():
                for seqs in (1, 64):
                    entries = seqs * (2 if per > 1 else 1)  # LocDiT: 2 CFG index entries per sequence
                    index = torch.tensor([1 + i % (slots - 1) for i in range(entries)])
                    rows = entries * per
                    for k_in, parts in ((k, outs), (outs[0], (k,))):  # q|k|v, then o
                        recorder.case = f"{name} {stack} {'q|k|v' if len(parts) > 1 else 'o'} c={seqs}"
                        lora_triton.lora_add_(torch.empty(rows, sum(parts), dtype=dtype),
                                              torch.empty(rows, k_in, dtype=dtype),
                                              torch.empty(slots, rank * len(parts), k_in, dtype=dtype),
                                              torch.empty(slots, sum(parts), rank, dtype=dtype), index, per,
                                              parts if len(parts) > 1 else None, variant=name)
    unique: dict[str, cases.Launch] = {}
    for launch in recorder.launches:
        unique.setdefault(launch.key(), launch)
    results = []
    for launch in unique.values():
        fn = getattr(lora_triton, launch.name)
        entry = {"kernel": launch.name, "case": launch.case, "options": {k: launch.options[k] for k in (
            "num_warps", "num_stages", "launch_pdl")}, "error": None}
        try:
            compiled = triton.compile(ASTSource(fn, launch.signature, launch.constexprs, launch.attrs),
                                      target=cases.TARGET, options=launch.options)
            entry.update(shared=compiled.metadata.shared, resources=resources(compiled.asm["cubin"]))
        except Exception as e:  # a report per launch, whatever the compiler raised
            entry["error"] = str(e)[-3000:]
        results.append(entry)
    launched: dict[str, set[str]] = {}
    for launch in recorder.launches:
        launched.setdefault(launch.case.split()[0], set()).add(launch.name)
    return {"variants": list(lora_triton.VARIANTS), "launched": {k: sorted(v) for k, v in launched.items()},
            "results": results}


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict:
    env = dict(os.environ, TRITON_INTERPRET="0", OMP_NUM_THREADS="1",
               TRITON_CACHE_DIR=str(tmp_path_factory.mktemp("triton-cache")))
    done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=240)
    if done.returncode != 0:
        pytest.fail(f"{Path(__file__).name} exited with {done.returncode}:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout)


def test_every_variant_compiles_for_sm90_without_spills(compiled) -> None:
    results = compiled["results"]
    assert set(compiled["launched"]) == set(compiled["variants"])  # each variant launched (its first case compiles)
    assert {r["kernel"] for r in results} >= {"_shrink_kernel", "_expand_kernel", "_fused_kernel", "_split_kernel"}
    assert any(r["options"]["launch_pdl"] for r in results)  # the PDL expand, not only its interpreter stand-in
    failures = [f"{r['kernel']} ({r['case']}): {r['error']}" for r in results if r["error"]]
    assert not failures, "\n\n".join(failures)
    for r in results:
        assert r["shared"] <= MAX_SHARED, r
        if r["resources"] is not None:
            assert r["resources"]["LOCAL"] == 0 and r["resources"]["STACK"] == 0, r  # no register spills


if __name__ == "__main__":
    print(json.dumps(report()))
