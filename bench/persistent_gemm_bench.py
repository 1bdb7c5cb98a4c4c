"""Can one persistent kernel run the LocDiT's batch-1 GEMM chain faster than a GEMM a launch? (H200 only)

s14b (`bench/pdl_gemm_bench.py`): at 22 rows every GEMM costs 5-10 us, cuBLAS or Triton, mostly fixed latency, and
the LocDiT runs ~430 of them a step. The plan left for issue 4's batch-1 target is a persistent LocDiT: one launch,
every SM a program, a grid-wide barrier between dependent phases (bench/results/README.md, end of s14). This asks
the question that plan stands on, before anyone writes it: what does a barrier plus a GEMM phase cost?

Chains of the LocDiT's GEMMs at c=1 (22 rows; q|k|v, o, gate|up, down per layer, 12 layers, weights of their own),
each GEMM's outputs written before the next starts:
- `cublas`: torch.mm a GEMM, in a CUDA graph (as the engine runs them now);
- `persistent_{P}x_k{B}`: one launch of `_chain_kernel`, P programs per SM (all resident), each looping over its
  share of the column tiles of every GEMM in turn (K blocks of B), with a grid barrier (an atomic arrival counter,
  spun on) after each GEMM;
- `persistent_no_barrier`: the same without the barriers (wrong as a chain; the barriers' cost is the difference).

Checked against torch first (phase by phase, one launch a GEMM, which is also how it runs in Triton's interpreter:
programs run one after another there, so a barrier would spin forever).

    python bench/persistent_gemm_bench.py [--out persistent.json]      (GPU, ~30 s)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gateway_proc import git_commit  # noqa: E402
from lora_bench import step_graph_us  # noqa: E402

REPLAYS = 50
ROWS, LAYERS = 22, 12  # the LocDiT at c=1: 2 CFG rows x 11 tokens
SHAPES = [(1024, 2560), (2048, 1024), (1024, 8192), (4096, 1024)]  # (K, N): q|k|v, o, gate|up, down
BLOCK_M, BLOCK_N, BLOCK_K = 32, 16, 128
# (programs per SM, BLOCK_K) of each persistent run: more programs a SM share a GEMM's tiles more finely (they must
# all stay resident: 24.5 KB of shared memory and 94 registers a thread each at BLOCK_K 128, so 4 fit)
VARIANTS = [(1, 128), (2, 128), (4, 128), (4, 64)]


@triton.jit
def _chain_kernel(x_table, w_table, y_table, k_table, n_table, count_ptr, first, last, programs,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROWS: tl.constexpr,
                  BARRIER: tl.constexpr, DTYPE: tl.constexpr):
    """GEMMs first..last-1 of the tables in order (y = x @ w^T, x [ROWS, K], w [N, K], y [ROWS, N], DTYPE), this
    program taking every `programs`-th column tile of each; with BARRIER, all programs wait for each other after
    each GEMM (they must all be resident: one a SM)."""
    pid = tl.program_id(0)
    rows = tl.arange(0, BLOCK_M)
    ks = tl.arange(0, BLOCK_K)
    for g in range(first, last):
        # the tables' values come at run time: without these hints (torch's allocations are 16-byte aligned, the
        # widths multiples of the blocks) every load is split into 2-byte ones and nothing is pipelined
        x_ptr = tl.multiple_of(tl.load(x_table + g).to(tl.pointer_type(DTYPE)), 16)
        w_ptr = tl.multiple_of(tl.load(w_table + g).to(tl.pointer_type(DTYPE)), 16)
        y_ptr = tl.multiple_of(tl.load(y_table + g).to(tl.pointer_type(DTYPE)), 16)
        k = tl.multiple_of(tl.load(k_table + g), BLOCK_K)
        n = tl.multiple_of(tl.load(n_table + g), BLOCK_N)
        for tile in range(pid, tl.cdiv(n, BLOCK_N), programs):
            cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
            acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            for k0 in range(0, k, BLOCK_K):
                x = tl.load(x_ptr + rows[:, None] * k + (k0 + ks)[None, :], mask=rows[:, None] < ROWS, other=0.0)
                w = tl.load(w_ptr + cols[None, :].to(tl.int64) * k + (k0 + ks)[:, None])
                acc = tl.dot(x, w, acc)
            tl.store(y_ptr + rows[:, None] * n + cols[None, :], acc.to(DTYPE), mask=rows[:, None] < ROWS)
        if BARRIER:
            tl.debug_barrier()  # every thread's stores issued before the release below
            tl.atomic_add(count_ptr, 1, sem="release", scope="gpu")
            target = (g + 1) * programs
            while tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu") < target:
                pass


class Chain:
    """The GEMM chain's tensors and the tables `_chain_kernel` reads (K, N multiples of BLOCK_K, BLOCK_N); float32
    for the interpreter, whose bf16 tl.dot is wrong."""

    def __init__(self, device: str, layers: int = LAYERS, rows: int = ROWS, seed: int = 0,
                 dtype: torch.dtype = torch.bfloat16):
        g = torch.Generator(device=device).manual_seed(seed)
        self.dtype = dtype
        self.xs = {k: torch.randn(rows, k, device=device, generator=g).to(dtype) for k, _ in SHAPES}
        self.ws = [(torch.randn(n, k, device=device, generator=g) * k ** -0.5).to(dtype)
                   for _ in range(layers) for k, n in SHAPES]
        self.ys = [torch.empty(rows, w.shape[0], device=device, dtype=dtype) for w in self.ws]
        table = lambda values: torch.tensor(values, device=device, dtype=torch.int64)  # noqa: E731
        self.x_table = table([self.xs[w.shape[1]].data_ptr() for w in self.ws])
        self.w_table = table([w.data_ptr() for w in self.ws])
        self.y_table = table([y.data_ptr() for y in self.ys])
        self.k_table = table([w.shape[1] for w in self.ws])
        self.n_table = table([w.shape[0] for w in self.ws])
        self.count = torch.zeros(1, device=device, dtype=torch.int32)

    def launch(self, first: int, last: int, programs: int, barrier: bool, block_k: int = BLOCK_K) -> None:
        _chain_kernel[(programs,)](self.x_table, self.w_table, self.y_table, self.k_table, self.n_table, self.count,
                                   first, last, programs, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=block_k,
                                   ROWS=self.xs[SHAPES[0][0]].shape[0], BARRIER=barrier,
                                   DTYPE=tl.float32 if self.dtype == torch.float32 else tl.bfloat16, num_warps=4,
                                   num_stages=3)

    def persistent(self, programs: int, barrier: bool = True, block_k: int = BLOCK_K) -> None:
        """The whole chain in one launch (the counter zeroed first: graph replays start over)."""
        self.count.zero_()
        self.launch(0, len(self.ws), programs, barrier, block_k)

    def phased(self, programs: int) -> None:
        """One launch a GEMM, no barrier: the interpreter's way, and the correctness reference's."""
        for g in range(len(self.ws)):
            self.launch(g, g + 1, programs, barrier=False)

    def max_error(self) -> float:
        """The largest relative error of any GEMM's output against fp32."""
        errors = []
        for w, y in zip(self.ws, self.ys, strict=True):
            want = self.xs[w.shape[1]].float() @ w.float().t()
            errors.append(float((y.float() - want).norm() / want.norm()))
        return max(errors)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("persistent_gemm_bench.py needs a GPU")
    started = time.perf_counter()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    chain = Chain("cuda")
    gemms = len(chain.ws)
    results = {}
    for ys in chain.ys:
        ys.fill_(float("nan"))
    chain.phased(sms)
    results["phased_max_rel_err"] = chain.max_error()
    runs = {
        "cublas": lambda: [torch.mm(chain.xs[w.shape[1]], w.t(), out=y) for w, y in zip(chain.ws, chain.ys,
                                                                                          strict=True)],
        "phased": lambda: chain.phased(sms),
        "persistent_no_barrier": lambda: chain.persistent(sms, barrier=False),
    }
    for per_sm, block_k in VARIANTS:
        name = f"persistent_{per_sm}x_k{block_k}"
        for ys in chain.ys:
            ys.fill_(float("nan"))
        chain.persistent(per_sm * sms, block_k=block_k)
        torch.cuda.synchronize()
        results[f"{name}_max_rel_err"] = chain.max_error()
        assert results[f"{name}_max_rel_err"] < 2e-2, results
        runs[name] = lambda p=per_sm * sms, b=block_k: chain.persistent(p, block_k=b)
    for name, run in runs.items():
        us = step_graph_us(run, REPLAYS)[0] / gemms
        results[f"{name}_us_per_gemm"] = round(us, 3)
        print(f"{name:22s} {us:6.2f} us a GEMM ({gemms} GEMMs of {ROWS} rows)", flush=True)
    floor = 1e6 * sum(w.numel() * 2 for w in chain.ws) / 4.8e12 / gemms
    print(f"HBM floor {floor:.2f} us a GEMM; largest error {max(v for k, v in results.items() if 'err' in k):.1e}")
    report = {"device": torch.cuda.get_device_name(), "git_commit": git_commit(),
              "sms": sms, "replays": REPLAYS, "rows": ROWS, "layers": LAYERS,
              "blocks_m_n": [BLOCK_M, BLOCK_N], "variants": VARIANTS, "hbm_floor_us_per_gemm": round(floor, 3),
              "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv),
              "seconds": round(time.perf_counter() - started, 1), "results": results}
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
