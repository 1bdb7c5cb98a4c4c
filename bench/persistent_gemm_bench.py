"""Can one persistent kernel run the LocDiT's batch-1 GEMM chain faster than a GEMM a launch? (H200 only)

s14b (`bench/pdl_gemm_bench.py`): at 22 rows every GEMM costs 5-10 us, cuBLAS or Triton, mostly fixed latency, and
the LocDiT runs ~430 of them a step. The plan left for issue 4's batch-1 target is a persistent LocDiT: one launch,
every SM a program, a grid-wide barrier between dependent phases (docs/decisions.md). This asks
the question that plan stands on, before anyone writes it: what does a barrier plus a GEMM phase cost?

Chains of the LocDiT's GEMMs at c=1 (22 rows; q|k|v, o, gate|up, down per layer, 12 layers, weights of their own),
each GEMM's outputs written before the next starts:
- `cublas`: torch.mm a GEMM, in a CUDA graph (as the engine runs them now);
- `persistent_{P}x_k{B}`: one launch of `_chain_kernel`, P programs per SM (all resident), each looping over its
  share of the column tiles of every GEMM in turn (K blocks of B), with a grid barrier (an atomic arrival counter,
  spun on) after each GEMM;
- `persistent_no_barrier`: the same without the barriers (wrong as a chain; the barriers' cost is the difference).
- `split_k_*` (after s15a: the variants above ran at ~10 us a GEMM, their K loops in series and the 22 input rows
  re-read for every 16 columns): `_split_k_kernel`, chunks of 64 columns x 256 of K, each loaded at once (32 KB of
  weights, 11 KB of input) and multiplied in one `tl.dot`, so a GEMM is ~1 load latency deep whatever its K; the
  fp32 partial products summed by atomics into y (`atomic`) or stored one per K chunk for the reader to sum
  (`partial`); `prefetch`: one chunk a program (4 programs a SM), the next GEMM's weights loaded before waiting at
  the barrier (the megakernel's way to hide them).

Checked against torch first (phase by phase, one launch a GEMM, which is also how it runs in Triton's interpreter:
programs run one after another there, so a barrier would spin forever).

    python bench/persistent_gemm_bench.py [--out persistent.json]      (GPU, ~30 s)
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gateway_proc import save_probe  # noqa: E402
from lora_bench import step_graph_us  # noqa: E402

REPLAYS = 50
REGISTERS_PER_SM = 65536  # sm_90
ROWS, LAYERS = 22, 12  # the LocDiT at c=1: 2 CFG rows x 11 tokens
SHAPES = [(1024, 2560), (2048, 1024), (1024, 8192), (4096, 1024)]  # (K, N): q|k|v, o, gate|up, down
BLOCK_M, BLOCK_N, BLOCK_K = 32, 16, 128
# (programs per SM, BLOCK_K) of each persistent run: more programs a SM share a GEMM's tiles more finely (they must
# all stay resident: 24.5 KB of shared memory and 94 registers a thread each at BLOCK_K 128, so 4 fit)
VARIANTS = [(1, 128), (2, 128), (4, 128), (4, 64)]
SPLIT_N, SPLIT_K, SPLIT_WARPS = 64, 256, 4  # `_split_k_kernel`'s chunk: LocDiT GEMMs of 128 (o) to 512 (gate|up) chunks
# (name, programs per SM, atomic, prefetch, barrier) of each split-K run; a run whose programs would not all be
# resident (registers: ~126 a thread without prefetch, ~210 with, at 4 warps) is skipped: its barrier would hang
SPLIT_VARIANTS = [("split_k_atomic_1x", 1, True, False, True), ("split_k_atomic_4x", 4, True, False, True),
                  ("split_k_partial_4x", 4, False, False, True),
                  ("split_k_partial_4x_no_barrier", 4, False, False, False),
                  ("split_k_prefetch_atomic_2x", 2, True, True, True),
                  ("split_k_prefetch_partial_2x", 2, False, True, True),
                  ("split_k_prefetch_partial_4x", 4, False, True, True)]


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


@triton.jit
def _chunk_x(x_ptr, k, chunk, valid, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, ROWS: tl.constexpr):
    """The input rows [BLOCK_M, BLOCK_K] of chunk `chunk` of a GEMM (K block chunk % (k / BLOCK_K)), zeros where
    not `valid`."""
    ks = (chunk % (k // BLOCK_K)) * BLOCK_K + tl.arange(0, BLOCK_K)
    rows = tl.arange(0, BLOCK_M)
    return tl.load(x_ptr + rows[:, None] * k + ks[None, :], mask=(rows[:, None] < ROWS) & valid, other=0.0)


@triton.jit
def _chunk_w(w_ptr, k, chunk, valid, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The weights [BLOCK_K, BLOCK_N] of chunk `chunk` (column tile chunk // (k / BLOCK_K)), zeros where not
    `valid`."""
    k_chunks = k // BLOCK_K
    cols = (chunk // k_chunks) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = (chunk % k_chunks) * BLOCK_K + tl.arange(0, BLOCK_K)
    return tl.load(w_ptr + cols[None, :].to(tl.int64) * k + ks[:, None], mask=valid, other=0.0)


@triton.jit
def _put_chunk(y_ptr, acc, k, n, chunk, valid, ATOMIC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, ROWS: tl.constexpr):
    """Chunk `chunk`'s fp32 partial product into y: added to y [ROWS, n] (ATOMIC), else stored as partial
    k-chunk of y [k / BLOCK_K, ROWS, n]."""
    k_chunks = k // BLOCK_K
    cols = (chunk // k_chunks) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    mask = (rows[:, None] < ROWS) & valid
    if ATOMIC:
        tl.atomic_add(y_ptr + rows[:, None] * n + cols[None, :], acc, mask=mask, sem="relaxed")
    else:
        tl.store(y_ptr + ((chunk % k_chunks) * ROWS + rows[:, None]) * n + cols[None, :], acc, mask=mask)


@triton.jit
def _grid_barrier(count_ptr, target):
    tl.debug_barrier()  # every thread's stores issued before the release below
    tl.atomic_add(count_ptr, 1, sem="release", scope="gpu")
    while tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu") < target:
        pass


@triton.jit
def _split_k_kernel(x_table, w_table, y_table, k_table, n_table, count_ptr, first, last, programs,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROWS: tl.constexpr,
                    BARRIER: tl.constexpr, ATOMIC: tl.constexpr, PREFETCH: tl.constexpr, DTYPE: tl.constexpr):
    """GEMMs first..last-1 of the tables (x [ROWS, K] and w [N, K] in DTYPE, y fp32: see `_put_chunk`), split into
    chunks of BLOCK_N columns x BLOCK_K of K, this program taking every `programs`-th chunk of each; with BARRIER a
    grid barrier after each GEMM. PREFETCH: each program's first chunk of the next GEMM's weights loaded before
    the barrier."""
    pid = tl.program_id(0)
    if PREFETCH:  # this program's first chunk of GEMM `first`'s weights
        k = tl.multiple_of(tl.load(k_table + first), BLOCK_K)
        n = tl.multiple_of(tl.load(n_table + first), BLOCK_N)
        w_ptr = tl.multiple_of(tl.load(w_table + first).to(tl.pointer_type(DTYPE)), 16)
        ahead = _chunk_w(w_ptr, k, pid, pid < (n // BLOCK_N) * (k // BLOCK_K), BLOCK_N, BLOCK_K)
    for g in range(first, last):
        k = tl.multiple_of(tl.load(k_table + g), BLOCK_K)
        n = tl.multiple_of(tl.load(n_table + g), BLOCK_N)
        x_ptr = tl.multiple_of(tl.load(x_table + g).to(tl.pointer_type(DTYPE)), 16)
        w_ptr = tl.multiple_of(tl.load(w_table + g).to(tl.pointer_type(DTYPE)), 16)
        y_ptr = tl.multiple_of(tl.load(y_table + g).to(tl.pointer_type(tl.float32)), 16)
        chunks = (n // BLOCK_N) * (k // BLOCK_K)
        start = pid
        if PREFETCH:  # the first chunk's weights came before the barrier; its input (a chain's last output) after
            x = _chunk_x(x_ptr, k, pid, pid < chunks, BLOCK_M, BLOCK_K, ROWS)
            _put_chunk(y_ptr, tl.dot(x, ahead), k, n, pid, pid < chunks, ATOMIC, BLOCK_M, BLOCK_N, BLOCK_K, ROWS)
            start = pid + programs
        for chunk in range(start, chunks, programs):
            x = _chunk_x(x_ptr, k, chunk, True, BLOCK_M, BLOCK_K, ROWS)
            w = _chunk_w(w_ptr, k, chunk, True, BLOCK_N, BLOCK_K)
            _put_chunk(y_ptr, tl.dot(x, w), k, n, chunk, True, ATOMIC, BLOCK_M, BLOCK_N, BLOCK_K, ROWS)
        if PREFETCH:  # the next GEMM's first chunk of weights: they do not wait for the barrier
            nxt = tl.minimum(g + 1, last - 1)
            k = tl.multiple_of(tl.load(k_table + nxt), BLOCK_K)
            n = tl.multiple_of(tl.load(n_table + nxt), BLOCK_N)
            w_ptr = tl.multiple_of(tl.load(w_table + nxt).to(tl.pointer_type(DTYPE)), 16)
            ahead = _chunk_w(w_ptr, k, pid, (pid < (n // BLOCK_N) * (k // BLOCK_K)) & (g + 1 < last), BLOCK_N,
                             BLOCK_K)
        if BARRIER:
            _grid_barrier(count_ptr, (g + 1) * programs)


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
        # `_split_k_kernel`'s fp32 outputs, each kind in one buffer: the sums [rows, N] the atomic variants add
        # into (one memset zeroes them all), the partial products [K / SPLIT_K, rows, N] the others store

        def flat(sizes: list[int]) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
            buffer = torch.zeros(sum(sizes), device=device, dtype=torch.float32)
            offsets = [0, *itertools.accumulate(sizes)][:-1]
            return (buffer, table([buffer.data_ptr() + 4 * o for o in offsets]),
                    [buffer[o:o + size] for o, size in zip(offsets, sizes, strict=True)])

        self.sums, self.sums_table, self.sums_each = flat([rows * w.shape[0] for w in self.ws])
        self.parts, self.parts_table, self.parts_each = flat([w.shape[1] // SPLIT_K * rows * w.shape[0]
                                                              for w in self.ws])

    def split_k(self, programs: int, atomic: bool, prefetch: bool = False, barrier: bool = True,
                first: int = 0, last: int | None = None, compile_only: bool = False):
        """GEMMs first..last-1 with `_split_k_kernel` in one launch (the counter zeroed first, and with `atomic`
        the accumulators too: they are summed into). `compile_only`: launch nothing, return the compiled kernel."""
        args = (self.x_table, self.w_table, self.sums_table if atomic else self.parts_table, self.k_table,
                self.n_table, self.count, first, len(self.ws) if last is None else last, programs)
        options = dict(BLOCK_M=BLOCK_M, BLOCK_N=SPLIT_N, BLOCK_K=SPLIT_K, ROWS=self.xs[SHAPES[0][0]].shape[0],
                       BARRIER=barrier, ATOMIC=atomic, PREFETCH=prefetch,
                       DTYPE=tl.float32 if self.dtype == torch.float32 else tl.bfloat16, num_warps=SPLIT_WARPS,
                       num_stages=1)
        if compile_only:
            return _split_k_kernel.warmup(*args, grid=(programs,), **options)
        self.count.zero_()
        if atomic:
            self.sums.zero_()
        return _split_k_kernel[(programs,)](*args, **options)

    def split_k_outputs(self, atomic: bool) -> list[torch.Tensor]:
        """Each GEMM's y [rows, N] from the split-K outputs (the partial products summed)."""
        rows = self.xs[SHAPES[0][0]].shape[0]
        if atomic:
            return [y.view(rows, -1) for y in self.sums_each]
        return [p.view(-1, rows, w.shape[0]).sum(0) for w, p in zip(self.ws, self.parts_each, strict=True)]

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

    def max_error(self, ys: list[torch.Tensor] | None = None) -> float:
        """The largest relative error of any GEMM's output (`ys`, default the chain's) against fp32."""
        errors = []
        for w, y in zip(self.ws, self.ys if ys is None else ys, strict=True):
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
    for name, per_sm, atomic, prefetch, barrier in SPLIT_VARIANTS:
        kernel = chain.split_k(per_sm * sms, atomic, prefetch, barrier, compile_only=True)
        kernel._init_handles()
        # registers are given out per warp in units of 256: all programs must be resident at once for the barrier
        per_program = -(-kernel.n_regs * 32 // 256) * 256 * SPLIT_WARPS
        results[f"{name}_registers"] = kernel.n_regs
        if barrier and per_sm * per_program > REGISTERS_PER_SM:
            results[f"{name}_skipped"] = f"{kernel.n_regs} registers a thread: {per_sm} programs do not fit a SM"
            print(f"{name:22s} skipped: {results[f'{name}_skipped']}", flush=True)
            continue
        chain.sums.fill_(float("nan"))
        chain.parts.fill_(float("nan"))
        chain.split_k(per_sm * sms, atomic, prefetch, barrier)
        torch.cuda.synchronize()
        results[f"{name}_max_rel_err"] = chain.max_error(chain.split_k_outputs(atomic))
        assert results[f"{name}_max_rel_err"] < 2e-2, results
        runs[name] = lambda p=per_sm * sms, a=atomic, f=prefetch, b=barrier: chain.split_k(p, a, f, b)
    runs["zero_sums"] = chain.sums.zero_  # what the atomic variants spend on their memset
    for name, run in runs.items():
        us = step_graph_us(run, REPLAYS)[0] / gemms
        results[f"{name}_us_per_gemm"] = round(us, 3)
        print(f"{name:22s} {us:6.2f} us a GEMM ({gemms} GEMMs of {ROWS} rows)", flush=True)
    floor = 1e6 * sum(w.numel() * 2 for w in chain.ws) / 4.8e12 / gemms
    print(f"HBM floor {floor:.2f} us a GEMM; largest error {max(v for k, v in results.items() if 'err' in k):.1e}")
    save_probe(args.out, started, torch.cuda.get_device_name(), sms=sms, replays=REPLAYS, rows=ROWS, layers=LAYERS,
               blocks_m_n=[BLOCK_M, BLOCK_N], variants=VARIANTS, hbm_floor_us_per_gemm=round(floor, 3),
               results=results)


if __name__ == "__main__":
    main()
