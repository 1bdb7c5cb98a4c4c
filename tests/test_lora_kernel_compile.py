"""Every LoRA kernel variant (engine.model.lora_triton.VARIANTS) compiles for the H200 (sm_90) without spilling.

tests/test_kernels_compile.py compiles what the launchers run by default (`fused=True/False`); bench/lora_bench.py
--step runs every variant on the GPU, so each must compile there too: the PDL launches, the wider expand tiles, 8
warps, 4 pipeline stages. This runs lora_add_ with each variant at VoxCPM2's q|k|v and o (LM and LocDiT, bf16, one
sequence and 64) through tests/kernel_compile_cases.py's recorder, compiles each distinct launch for sm_90, and reads
each cubin's registers, local memory (spills) and stack with the cuobjdump Triton ships. Like the other compile test it
needs TRITON_INTERPRET=0, hence a subprocess running this file as a script, once per group of variants: the default
suite checks the two `lora_add_` runs by default (SMALL_VARIANT, LARGE_VARIANT); the benchmark's others are `heavy`
(CI runs them, `make test` does not).
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
PATH_KERNELS = {"two": {"_shrink_kernel", "_expand_kernel"}, "one": {"_fused_kernel"}, "split": {"_split_kernel"}}


def variant_group(group: str) -> list[str]:
    """The variants of a group: "default" (what `lora_add_` runs unless told otherwise) or "others"."""
    from engine.model import lora_triton

    default = sorted({lora_triton.SMALL_VARIANT, lora_triton.LARGE_VARIANT})
    return default if group == "default" else [v for v in lora_triton.VARIANTS if v not in default]


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


def report(group: str) -> dict:
    """Compile the launches of a group's variants; the JSON the test reads."""
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
        for name in variant_group(group):
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
    return {"variants": {name: lora_triton.VARIANTS[name]._asdict() for name in variant_group(group)},
            "launched": {k: sorted(v) for k, v in launched.items()}, "results": results}


@pytest.fixture(scope="module", params=["default", pytest.param("others", marks=pytest.mark.heavy)])
def compiled(request, tmp_path_factory) -> dict:
    env = dict(os.environ, TRITON_INTERPRET="0", OMP_NUM_THREADS="1",
               TRITON_CACHE_DIR=str(tmp_path_factory.mktemp("triton-cache")))
    done = subprocess.run([sys.executable, __file__, request.param], env=env, capture_output=True, text=True,
                          timeout=240)
    if done.returncode != 0:
        pytest.fail(f"{Path(__file__).name} exited with {done.returncode}:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout)


def test_every_variant_compiles_for_sm90_without_spills(compiled) -> None:
    results = compiled["results"]
    variants = compiled["variants"]
    assert variants and set(compiled["launched"]) == set(variants)  # each variant launched (its first case compiles)
    for name, variant in variants.items():  # each ran its path's kernels
        assert PATH_KERNELS[variant["path"]] <= set(compiled["launched"][name]), name
    if any(v["pdl"] for v in variants.values()):  # the PDL expand, not only its interpreter stand-in
        assert any(r["options"]["launch_pdl"] for r in results)
    failures = [f"{r['kernel']} ({r['case']}): {r['error']}" for r in results if r["error"]]
    assert not failures, "\n\n".join(failures)
    for r in results:
        assert r["shared"] <= MAX_SHARED, r
        if r["resources"] is not None:
            assert r["resources"]["LOCAL"] == 0 and r["resources"]["STACK"] == 0, r  # no register spills


if __name__ == "__main__":
    print(json.dumps(report(sys.argv[1] if len(sys.argv) > 1 else "default")))
