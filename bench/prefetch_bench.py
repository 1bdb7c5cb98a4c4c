"""Would prefetching the next linear's weights into L2 speed up a batch-1 decode step? (H200 only)

A batch-1 step is ~1,900 dependent kernels; its GEMMs (22 LocDiT rows, 1 LM row) stream 5-50 MB of weights each at
0.7-3 TB/s, latency-bound rather than bandwidth-bound (bench/results/README.md, s9a). While one GEMM runs, HBM has
bandwidth to spare: a side-stream kernel could pull the next linear's weights into L2 (`cp.async.bulk.prefetch.L2`:
one instruction per chunk, the thread does not wait), so that GEMM reads L2 instead of HBM.

Per shape, one CUDA graph runs a chain of GEMMs as a step does (each its own weight copy, the chain several times
the L2, so every GEMM starts cold), timed per GEMM:
- cold: the chain alone;
- hot: one weight copy for the whole chain (what the GEMM costs from L2: the bound on what a prefetch can give);
- next / ahead2: the chain with the weights of the GEMM one / two places ahead prefetched beside each GEMM;
- fork: `next`'s graph shape (a side-stream kernel forked beside each GEMM) with a kernel that prefetches nothing: what
  the fork itself costs the chain.
Then whole layers (q|k|v, o, gate|up, down in turn, each layer its own weights) cold and with `next`.

    python bench/prefetch_bench.py [--out prefetch.json]      (GPU, ~20 s)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import triton
import triton.language as tl

CHUNK = 64 << 10  # bytes per bulk prefetch (a multiple of 16)
LANES = 32  # prefetches per program (one warp, one each)
REPLAYS = 50
L2_MULTIPLE = 6  # every chain reads at least this many times the L2
# (rows, K, N) of one step's linears: LocDiT at c=1 (2 CFG rows x 11 tokens), LM at c=1
SHAPES = {
    "dit": (22, [(1024, 2560), (2048, 1024), (1024, 8192), (4096, 1024)]),
    "lm": (1, [(2048, 2560), (2048, 2048), (2048, 12288), (6144, 2048)]),
}
NAMES = ("q|k|v", "o", "gate|up", "down")


@triton.jit
def _l2_prefetch_kernel(ptr, nbytes, CHUNK: tl.constexpr, LANES: tl.constexpr):
    """Ask L2 for bytes [i * CHUNK, (i + 1) * CHUNK) of ptr, one chunk per lane; nothing waits for them."""
    i = tl.program_id(0) * LANES + tl.arange(0, LANES)
    start = i.to(tl.int64) * CHUNK
    size = tl.minimum(nbytes - start, CHUNK).to(tl.int32)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [ptr + tl.where(size > 0, start, 0), size], dtype=tl.int32, is_pure=False, pack=1)


def prefetch(w: torch.Tensor, empty: bool = False) -> None:
    """Launch the L2 prefetch of w's bytes (contiguous) on the current stream (`empty`: one program, no bytes)."""
    flat = w.view(torch.uint8).view(-1)
    nbytes = 0 if empty else flat.numel() // 16 * 16
    grid = (max(1, triton.cdiv(nbytes, CHUNK * LANES)),)
    _l2_prefetch_kernel[grid](flat, nbytes, CHUNK=CHUNK, LANES=LANES, num_warps=1)


def chain(x: dict[int, torch.Tensor], weights: list[torch.Tensor], ahead: int, side: torch.cuda.Stream,
          empty: bool = False) -> Callable[[], None]:
    """GEMM after GEMM over `weights` (x by K), each with the weights `ahead` places on prefetched beside it."""
    outs = [torch.empty(x[w.shape[1]].shape[0], w.shape[0], device="cuda", dtype=w.dtype) for w in weights]

    def run() -> None:
        main = torch.cuda.current_stream()
        for i, w in enumerate(weights):
            if ahead and i + ahead < len(weights):
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    prefetch(weights[i + ahead], empty)
            torch.mm(x[w.shape[1]], w.t(), out=outs[i])
        if ahead:
            main.wait_stream(side)
    return run


def graph_us(run: Callable[[], None], gemms: int) -> float:
    """Median us per GEMM of a CUDA graph of `run`."""
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(REPLAYS):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(1e3 * start.elapsed_time(end) / gemms)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("prefetch_bench.py needs a GPU")
    started = time.perf_counter()
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    side = torch.cuda.Stream()
    dtype = torch.bfloat16
    results: dict = {"per_linear": [], "layers": []}
    for stack, (rows, shapes) in SHAPES.items():
        x = {k: torch.randn(rows, k, device="cuda", dtype=dtype) for k in {k for k, _ in shapes}}
        for name, (k, n) in zip(NAMES, shapes, strict=True):
            copies = max(8, -(-L2_MULTIPLE * l2 // (k * n * 2)))
            weights = [torch.randn(n, k, device="cuda", dtype=dtype) * k ** -0.5 for _ in range(copies)]
            row = {"stack": stack, "linear": name, "rows": rows, "k": k, "n": n, "mb": k * n * 2 / 1e6,
                   "copies": copies,
                   "cold_us": graph_us(chain(x, weights, 0, side), copies),
                   "hot_us": graph_us(chain(x, [weights[0]] * copies, 0, side), copies),
                   "next_us": graph_us(chain(x, weights, 1, side), copies),
                   "ahead2_us": graph_us(chain(x, weights, 2, side), copies),
                   "fork_us": graph_us(chain(x, weights, 1, side, empty=True), copies)}
            results["per_linear"].append(row)
            print(f"{stack} {name:8s} {rows:3d}x{k}->{n} {row['mb']:5.1f} MB: cold {row['cold_us']:6.2f}  "
                  f"hot {row['hot_us']:6.2f}  next {row['next_us']:6.2f}  ahead2 {row['ahead2_us']:6.2f}  "
                  f"fork {row['fork_us']:6.2f} us",
                  flush=True)
            del weights
        layers = 12 if stack == "dit" else 28
        weights = [torch.randn(n, k, device="cuda", dtype=dtype) * k ** -0.5 for _ in range(layers) for k, n in shapes]
        row = {"stack": stack, "layers": layers, "cold_us": graph_us(chain(x, weights, 0, side), len(weights)),
               "next_us": graph_us(chain(x, weights, 1, side), len(weights)),
               "ahead2_us": graph_us(chain(x, weights, 2, side), len(weights))}
        results["layers"].append(row)
        print(f"{stack} {layers} layers, us per GEMM: cold {row['cold_us']:.2f}  next {row['next_us']:.2f}  "
              f"ahead2 {row['ahead2_us']:.2f}", flush=True)
        del weights
        torch.cuda.empty_cache()
    report = {"device": torch.cuda.get_device_name(), "l2_bytes": l2, "chunk": CHUNK, "lanes": LANES,
              "replays": REPLAYS, "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv),
              "seconds": round(time.perf_counter() - started, 1), **results}
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
