"""Benchmarks of the batched-LoRA kernels (engine.model.lora_triton.lora_add_) at VoxCPM2's LoRA'd linears.

Default mode, one linear at a time. Shapes (rank 32 by default, bf16 (fp16 under --tiny), 32 adapter slots + slot 0
as `--lora 32` registers): LM q|k|v (K 2048 -> 2048, 256, 256) and o (2048 -> 2048) at rows 1, 4, 8, 64 (decode at
c=1..64) and 4096 (prefill); LocDiT q|k|v (1024 -> 2048, 256, 256) and o (2048 -> 1024) at rows 22, 44, 88, 1408 (c=1,
2, 4, 64: 2 CFG rows x 11 tokens per sequence, so 11 rows per index entry). Each with no adapter (slot 0 everywhere),
one adapter, and 32 adapters spread round-robin over the index entries.
Both paths run every case: two launches (shrink, expand) and the one launch (`fused=True`: the split-K kernel where
`plan` splits K, else `_fused_kernel`) at each of the module's BLOCK_N x BLOCK_K and those of `--fused-tiles`; `pick`
is the path `lora_add_` takes, and `lora_us` its time. Each is checked against a per-slot torch reference (max abs
error of the delta), then timed as the engine runs it: `segments` computed once (the engine shares them per step), a
CUDA graph of REPEAT back-to-back calls, median replay time / REPEAT. The base linear's GEMM at the same rows is timed
the same way for scale, and the last lines add the kernels up over one VoxCPM2 decode step (36 LM layers, 12 LocDiT
layers x 9 evaluated Euler steps; the 4 projections left out), with the picked paths and with two launches everywhere.
Replaying one linear keeps its weights in L2, so these times undershoot a real step's.

--step: what a decode step pays. Per stack and batch, ONE CUDA graph runs the stack's attention linears as a step
does: the LocDiT's 12 layers x 9 evaluations (10 timesteps, the first at velocity 0), the base LM's 28 layers, each
layer a q|k|v GEMM then an o GEMM (o reads the q block of q|k|v's output), every layer with its own weights and
adapters (so nothing stays in L2 from one layer to the next, as in the step), rows as the model builds them (LocDiT:
2 CFG index entries per sequence, 11 tokens each; LM: 1 row per sequence), adapters round-robin over 32 slots, and
`segment_rows` once per graph. The base-only graph is timed (and with `segment_rows` alone: the per-step cost all
variants share), then one graph per variant (every `VARIANTS` entry, and `default`: what `choose` picks), each LoRA op
forced to it: overhead = graph - base graph, per LoRA op = overhead / ops.
Each variant's last outputs are checked against a torch reference and replayed twice for bit-reproducibility. The
table's last lines project a whole step's LoRA overhead from the per-op costs (216 LocDiT + 72 LM ops; the residual
LM runs the LM's shapes) against the no-LoRA step measured on the H200 (STEP_MS_NO_LORA).

    .venv/bin/python bench/lora_bench.py [--out lora.json] [--rank 32]   (GPU, ~1-2 minutes)
    .venv/bin/python bench/lora_bench.py --step [--out step.json]          (GPU, < 90 s)
    .venv/bin/python bench/lora_bench.py [--step] --tiny                   (CPU, Triton's interpreter: small shapes,
                                                                           checks only; its times mean nothing)
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# the interpreter must be on before triton is imported (torch imports it)
if "--tiny" in sys.argv and not Path("/dev/nvidia0").exists():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Iterator  # noqa: E402
from datetime import UTC, datetime  # noqa: E402
from typing import NamedTuple  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from gateway_proc import git_commit  # noqa: E402  (bench/ is on the path: this file's folder)

from engine.config import ModelConfig  # noqa: E402
from engine.model import lora_triton  # noqa: E402
from engine.model.euler import euler_schedule, zero_velocity_steps  # noqa: E402
from engine.model_configs import voxcpm2  # noqa: E402

ADAPTERS = 32
REPEAT = 20
DIT_TOKENS = 11  # LocDiT tokens per sequence: mu x 2, t, 4 cond, 4 x
TIMESTEPS = 10  # the engine's default inference_timesteps
DIT_EVALS = len(euler_schedule(TIMESTEPS)) - zero_velocity_steps(TIMESTEPS)  # LocDiT runs per step: 9
SHAPES = {  # name: (K, outs of the linears sharing x); the name's first word is the stack
    "lm qkv": (2048, (2048, 256, 256)),
    "lm o": (2048, (2048,)),
    "dit qkv": (1024, (2048, 256, 256)),
    "dit o": (2048, (1024,)),
}
ROWS = {"lm": (1, 4, 8, 64, 4096), "dit": tuple(2 * DIT_TOKENS * c for c in (1, 2, 4, 64))}
TINY_SHAPES = {"lm qkv": (256, (160, 16, 16)), "lm o": (128, (40,)), "dit qkv": (128, (32, 16, 16)),
               "dit o": (96, (24,))}
TINY_ROWS = {"lm": (1, 8), "dit": (22, 44)}
CONCURRENCY = (1, 4, 64)  # decode steps added up: LM rows c, LocDiT rows 22c
# one VoxCPM2 decode step: (shape, LM rows or LocDiT rows) -> linears per step
STEP = {("lm qkv", "lm"): 28 + 8, ("lm o", "lm"): 28 + 8, ("dit qkv", "dit"): 12 * DIT_EVALS,
        ("dit o", "dit"): 12 * DIT_EVALS}


def rows_per_index(stack: str) -> int:
    return DIT_TOKENS if stack == "dit" else 1


def make_case(k: int, outs: tuple[int, ...], rank: int, rows: int, per: int, adapters: int, device: str,
              dtype: torch.dtype) -> dict:
    gen = torch.Generator(device).manual_seed(rows * 31 + k + adapters)
    entries = rows // per
    slots = [0 if adapters == 0 else 1 + i % adapters for i in range(entries)]
    num_slots = ADAPTERS + 1
    randn = lambda *shape, scale: (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)
    a = randn(num_slots, rank * len(outs), k, scale=k ** -0.5)
    b = randn(num_slots, sum(outs), rank, scale=1e-3 * rank ** -0.5)  # small: y can take many timed replays
    a[0], b[0] = 0, 0
    return {"x": randn(rows, k, scale=1.0), "y": randn(rows, sum(outs), scale=1.0), "a": a, "b": b,
            "w": randn(sum(outs), k, scale=k ** -0.5), "index": torch.tensor(slots, device=device), "per": per,
            "outs": outs}


@contextlib.contextmanager
def fused_tiles(tiles: str) -> Iterator[None]:
    """The one-launch kernel with BLOCK_N x BLOCK_K = `tiles` ("128x128"): lora_add_ reads the module's constants
    at each call, and a CUDA graph keeps what it captured."""
    saved = lora_triton.FUSED_BLOCK_N, lora_triton.FUSED_BLOCK_K
    lora_triton.FUSED_BLOCK_N, lora_triton.FUSED_BLOCK_K = (int(v) for v in tiles.split("x"))
    try:
        yield
    finally:
        lora_triton.FUSED_BLOCK_N, lora_triton.FUSED_BLOCK_K = saved


def reference(c: dict) -> torch.Tensor:
    """y + LoRA in fp32, one matmul pair per slot in use (a gather of A per row would not fit at 4096 rows)."""
    y = c["y"].float().clone()
    row_slots = c["index"].repeat_interleave(c["per"])
    rank = c["b"].shape[2]
    for s in row_slots.unique().tolist():
        if s == 0:
            continue
        rows = (row_slots == s).nonzero().squeeze(1)
        t = c["x"][rows].float() @ c["a"][s].float().T
        parts, start = [], 0
        for j, n in enumerate(c["outs"]):
            parts.append(t[:, j * rank:(j + 1) * rank] @ c["b"][s, start:start + n].float().T)
            start += n
        y[rows] += torch.cat(parts, dim=1)
    return y


def captured(fn: Callable[[], object], calls: int = 1) -> torch.cuda.CUDAGraph:
    """A CUDA graph of `calls` back-to-back calls of `fn`, after one eager call on a side stream (compiles and warms
    up outside the capture)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph


def graph_us(fn: Callable[[], object]) -> float:
    """Median us of one call, from a CUDA graph of REPEAT back-to-back calls (as a step graph runs them)."""
    from triton.testing import do_bench

    graph = captured(fn, REPEAT)
    return 1e3 * do_bench(graph.replay, warmup=20, rep=100, return_mode="median") / REPEAT


def cpu_us(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return 1e6 * (time.perf_counter() - start)


def run_case(name: str, k: int, outs: tuple[int, ...], rank: int, rows: int, adapters: int, device: str,
             dtype: torch.dtype, tiles: list[str]) -> dict:
    per = rows_per_index(name.split()[0])
    c = make_case(k, outs, rank, rows, per, adapters, device, dtype)
    timer = graph_us if device == "cuda" else cpu_us
    seg = lora_triton.segment_rows(c["index"], per, ADAPTERS + 1)
    plan = lora_triton.plan(k, seg.grid, torch.device(device))
    picked = lora_triton.fuse(rows, k, rank, sum(-(-n // lora_triton.FUSED_BLOCK_N) for n in outs), seg.grid,
                              c["x"].element_size())
    ref = reference({**c, "y": torch.zeros_like(c["y"])})
    changed = True  # every path changes y exactly when there are adapters

    def measure(fused: bool) -> tuple[float, float, float]:
        """(us, max abs error, max error relative to the delta's largest) of one path."""
        nonlocal changed
        # checked on y = 0: the delta alone, so bf16's rounding of y cannot hide an error in it
        out = torch.zeros_like(c["y"])
        lora_triton.lora_add_(out, c["x"], c["a"], c["b"], c["index"], per, outs, seg, fused=fused)
        err = (out.float() - ref).abs().max().item()
        changed &= (out.float().abs().max().item() > 0) == (adapters > 0)
        y = c["y"].clone()
        us = timer(lambda: lora_triton.lora_add_(y, c["x"], c["a"], c["b"], c["index"], per, outs, seg, fused=fused))
        return us, err, err / max(ref.abs().max().item(), 1e-30)

    two_us, two_err, two_rel = measure(False)
    one: dict[str, tuple[float, float, float]] = {}
    for t in tiles:
        with fused_tiles(t):
            one[t] = measure(True)
    used = len({s for s in c["index"].tolist() if s})
    size = c["x"].element_size()
    a_rows = rank * len(outs)
    moved = (used * a_rows * k + used * sum(outs) * rank) * size  # A and B of the slots in use
    if used:
        moved += (rows * k + 2 * rows * sum(outs)) * size + 2 * plan.splits * rows * a_rows * 4  # x, y, t partials
    return {"shape": name, "k": k, "outs": list(outs), "rank": rank, "rows": rows, "rows_per_index": per,
            "adapters": adapters, "grid": seg.grid, "splits": plan.splits, "one_launch_picked": picked,
            "lora_us": one[tiles[0]][0] if picked else two_us, "two_launch_us": two_us,
            "one_launch_us": {t: v[0] for t, v in one.items()}, "two_launch_max_abs_err": two_err,
            "one_launch_max_abs_err": {t: v[1] for t, v in one.items()},
            "max_rel_err": max(two_rel, *(v[2] for v in one.values())),
            "base_gemm_us": gemm_us(timer, k, sum(outs), rows, device, dtype),
            "segment_rows_us": segments_us(timer, rows, per, adapters, device),
            "gbs": moved / two_us / 1e3, "delta_as_expected": changed}


@functools.cache
def gemm_us(timer: Callable, k: int, n: int, rows: int, device: str, dtype: torch.dtype) -> float:
    """The base linear at these rows (the same for every adapter count)."""
    x, w = torch.randn(rows, k, device=device, dtype=dtype), torch.randn(n, k, device=device, dtype=dtype)
    return timer(lambda: F.linear(x, w))


@functools.cache
def segments_us(timer: Callable, rows: int, per: int, adapters: int, device: str) -> float:
    """segment_rows once per step and row group (the same for every shape)."""
    index = torch.tensor([0 if adapters == 0 else 1 + i % adapters for i in range(rows // per)], device=device)
    return timer(lambda: lora_triton.segment_rows(index, per, ADAPTERS + 1))


def step_estimate(results: list[dict], lm_rows: int, adapters: int, key: str = "lora_us") -> float | None:
    """us of LoRA kernels in one decode step at lm_rows sequences (None when a shape was not measured)."""
    by = {(r["shape"], r["rows"], r["adapters"]): r[key] for r in results}
    total = 0.0
    for (shape, stack), count in STEP.items():
        rows = lm_rows if stack == "lm" else 2 * DIT_TOKENS * lm_rows
        if (shape, rows, adapters) not in by:
            return None
        total += count * by[(shape, rows, adapters)]
    return total


# ---- --step: a decode step's LoRA'd attention linears, one CUDA graph per stack, batch and variant ----------------

STEP_BATCHES = (1, 64)
TINY_STEP_BATCHES = (1, 4)
STEP_REPLAYS = 15
# the whole no-LoRA decode step on the H200 (engine_bench, CUDA graphs, issue 9's figures) by batch: the
# denominator of the step-overhead projection
STEP_MS_NO_LORA = {1: 7.66, 64: 22.4}
STEP_TOLERANCE = 3e-2  # max error of a delta against the fp32 reference, relative to its largest (bf16 y rounding)
DEFAULT = "default"  # the pseudo-variant: lora_add_ choosing (lora_triton.choose)
SEGMENTS = "segments"  # the base graph plus segment_rows alone: the per-step cost every variant shares


class StepShape(NamedTuple):
    """One stack's LoRA'd attention linears over a step: `layers` layers run `evals` times, each q|k|v (`k` ->
    `outs`) then o (outs[0] -> `o_out`); `per` rows per index entry, `entries` index entries per sequence;
    `step_layers`: the layers of these shapes a real step runs (the LM's: base and residual)."""

    layers: int
    evals: int
    k: int
    outs: tuple[int, ...]
    o_out: int
    per: int
    entries: int
    step_layers: int

    def ops(self, layers: int | None = None) -> int:
        """LoRA ops (q|k|v and o) over `layers` layers (default: the graph's)."""
        return 2 * (layers or self.layers) * self.evals


def step_shapes() -> dict[str, StepShape]:
    """VoxCPM2's, from its config: the LocDiT (2 CFG index entries per sequence, 11 tokens each) and the base LM."""
    cfg = ModelConfig.from_dict(voxcpm2())

    def attention(stack, layers: int, evals: int, per: int, entries: int, step_layers: int) -> StepShape:
        q, kv = stack.num_attention_heads * stack.head_dim, stack.num_key_value_heads * stack.head_dim
        return StepShape(layers, evals, stack.hidden_size, (q, kv, kv), stack.hidden_size, per, entries, step_layers)

    dit, lm = cfg.dit_lm, cfg.lm
    return {"dit": attention(dit, dit.num_hidden_layers, DIT_EVALS, DIT_TOKENS, 2, dit.num_hidden_layers),
            "lm": attention(lm, lm.num_hidden_layers, 1, 1, 1, lm.num_hidden_layers + cfg.residual_lm_num_layers)}


# K of a few one-launch K steps (128), so the split kernel runs (all but the LocDiT o, whose K is one step)
TINY_STEP = {"dit": StepShape(2, 2, 256, (128, 16, 16), 64, DIT_TOKENS, 2, 2),
             "lm": StepShape(2, 1, 384, (256, 32, 32), 128, 1, 1, 2)}


def step_layers(shape: StepShape, rank: int, device: str, dtype: torch.dtype) -> list[dict[str, torch.Tensor]]:
    """Each layer's own base weights and adapter slots (slot 0 zero). Scales keep y and the deltas O(1), so bf16's
    rounding of y stays small against the delta the check measures."""
    gen = torch.Generator(device).manual_seed(shape.k + shape.layers)
    slots, n = ADAPTERS + 1, sum(shape.outs)
    randn = lambda *size, scale: (torch.randn(*size, generator=gen, device=device) * scale).to(dtype)
    layers = []
    for _ in range(shape.layers):
        layer = {"w_qkv": randn(n, shape.k, scale=shape.k ** -0.5),
                 "w_o": randn(shape.o_out, shape.outs[0], scale=shape.outs[0] ** -0.5),
                 "a_qkv": randn(slots, rank * len(shape.outs), shape.k, scale=shape.k ** -0.5),
                 "b_qkv": randn(slots, n, rank, scale=rank ** -0.5),
                 "a_o": randn(slots, rank, shape.outs[0], scale=shape.outs[0] ** -0.5),
                 "b_o": randn(slots, shape.o_out, rank, scale=rank ** -0.5)}
        for name in ("a_qkv", "b_qkv", "a_o", "b_o"):
            layer[name][0] = 0
        layers.append(layer)
    return layers


class StepCase(NamedTuple):
    """One stack at one batch: its layers, activations and row slots."""

    stack: str
    batch: int
    shape: StepShape
    layers: list[dict[str, torch.Tensor]]
    x: torch.Tensor
    y: torch.Tensor
    yo: torch.Tensor
    index: torch.Tensor

    def body(self, variant: str | None) -> Callable[[], None]:
        """The step's linears: per evaluation and layer, q|k|v GEMM (+ LoRA), o GEMM on q's block (+ LoRA);
        variant None: the base model, SEGMENTS: that and segment_rows, DEFAULT: lora_add_ choosing, else that
        VARIANTS entry everywhere."""
        shape, index, x, y, yo = self.shape, self.index, self.x, self.y, self.yo
        xo = y[:, :shape.outs[0]]
        forced = None if variant == DEFAULT else variant
        lora = variant not in (None, SEGMENTS)

        def run() -> None:
            seg = None if variant is None else lora_triton.segment_rows(index, shape.per, ADAPTERS + 1)
            for _ in range(shape.evals):
                for layer in self.layers:
                    torch.mm(x, layer["w_qkv"].t(), out=y)
                    if lora:
                        lora_triton.lora_add_(y, x, layer["a_qkv"], layer["b_qkv"], index, shape.per, shape.outs, seg,
                                              variant=forced)
                    torch.mm(xo, layer["w_o"].t(), out=yo)
                    if lora:
                        lora_triton.lora_add_(yo, xo, layer["a_o"], layer["b_o"], index, shape.per, None, seg,
                                              variant=forced)
        return run

    def error(self) -> float:
        """Max error of the last layer's two deltas (as y and yo hold them) against the fp32 reference, relative to
        the delta's largest: the base GEMMs recomputed, subtracted."""
        last, shape = self.layers[-1], self.shape
        worst = 0.0
        for x, y, w, a, b, outs in ((self.x, self.y, last["w_qkv"], last["a_qkv"], last["b_qkv"], shape.outs),
                                    (self.y[:, :shape.outs[0]], self.yo, last["w_o"], last["a_o"], last["b_o"],
                                     (shape.o_out,))):
            ref = reference({"x": x, "y": torch.zeros(y.shape, device=y.device), "a": a, "b": b,
                             "index": self.index, "per": shape.per, "outs": outs})
            got = y.float() - torch.mm(x, w.t()).float()
            worst = max(worst, (got - ref).abs().max().item() / max(ref.abs().max().item(), 1e-30))
        return worst


def step_case(stack: str, shape: StepShape, batch: int, layers: list[dict[str, torch.Tensor]], device: str,
              dtype: torch.dtype) -> StepCase:
    gen = torch.Generator(device).manual_seed(batch)
    entries = batch * shape.entries
    seqs = [1 + i % ADAPTERS for i in range(batch)]  # adapters round-robin over the sequences
    # LocDiT: the conditional rows' entries, then the unconditional ones (LoRAState.begin_sampling)
    index = torch.tensor(seqs * shape.entries, device=device)
    rows = entries * shape.per
    x = (torch.randn(rows, shape.k, generator=gen, device=device)).to(dtype)
    return StepCase(stack, batch, shape, layers, x, torch.empty(rows, sum(shape.outs), device=device, dtype=dtype),
                    torch.empty(rows, shape.o_out, device=device, dtype=dtype), index)


def step_graph_us(run: Callable[[], None], replays: int) -> tuple[float, torch.cuda.CUDAGraph]:
    """Median us of one replay of a CUDA graph of `run` (compiled and warmed up eagerly first)."""
    graph = captured(run)
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(1e3 * start.elapsed_time(end))
    return statistics.median(times), graph


def step_variant(case: StepCase, variant: str, base_us: float | None, replays: int) -> dict:
    """Time (GPU) or just run (CPU) the case with `variant`; check the last outputs; on GPU replay twice more for
    bit-reproducibility."""
    ops = case.shape.ops()
    out: dict = {"error": None}
    try:
        if base_us is None:  # CPU: the interpreter, no graph, no time
            case.body(variant)()
            out.update(us=None, overhead_us=None, overhead_pct=None, us_per_op=None, reproducible=None)
        else:
            us, graph = step_graph_us(case.body(variant), replays)
            graph.replay()
            first = (case.y.clone(), case.yo.clone())
            graph.replay()
            torch.cuda.synchronize()
            del graph
            out.update(us=us, overhead_us=us - base_us, overhead_pct=100 * (us - base_us) / base_us,
                       us_per_op=(us - base_us) / ops,
                       reproducible=torch.equal(first[0], case.y) and torch.equal(first[1], case.yo))
        out["max_rel_err"] = case.error()
    except Exception as e:  # a variant that fails (e.g. PDL refused in capture) is reported, the others still run
        out["error"] = f"{type(e).__name__}: {e}"[:2000]
    return out


def kernel_resources() -> list[dict]:
    """Registers, spills and shared memory of every LoRA kernel compiled in this process (best effort: Triton's
    caches are not a public API)."""
    found = []
    for name in ("_tile_table_kernel", "_shrink_kernel", "_expand_kernel", "_fused_kernel", "_split_kernel"):
        fn = getattr(lora_triton, name)
        try:
            for cache in fn.device_caches.values():
                for kernel in cache[0].values():
                    meta = kernel.metadata
                    constants = getattr(getattr(kernel, "src", None), "constants", None) or {}
                    found.append({"kernel": name, "num_warps": meta.num_warps, "num_stages": meta.num_stages,
                                  "launch_pdl": getattr(meta, "launch_pdl", None), "shared": meta.shared,
                                  "n_regs": getattr(kernel, "n_regs", None),
                                  "n_spills": getattr(kernel, "n_spills", None),
                                  "constexprs": {fn.arg_names[k[0]]: str(v) for k, v in constants.items()
                                                 if isinstance(k, tuple) and len(k) == 1}})
        except Exception as e:  # noqa: BLE001 - informative only
            found.append({"kernel": name, "error": repr(e)})
    return found


def step_main(args: argparse.Namespace, device: str, dtype: torch.dtype, rank: int) -> None:
    """--step: per stack and batch, the base graph and one graph per variant; JSON, then a short table."""
    shapes = TINY_STEP if args.tiny else step_shapes()
    batches = [int(b) for b in args.batches.split(",")] if args.batches else \
        list(TINY_STEP_BATCHES if args.tiny else STEP_BATCHES)
    names = args.variants.split(",") if args.variants else [DEFAULT, *lora_triton.VARIANTS]
    unknown = [n for n in names if n != DEFAULT and n not in lora_triton.VARIANTS]
    if unknown:
        sys.exit(f"unknown variants {unknown}; known: {[DEFAULT, *lora_triton.VARIANTS]}")
    # PDL last: a launch the driver mishandles could spoil the context for whatever runs after it
    names.sort(key=lambda n: n != DEFAULT and lora_triton.VARIANTS[n].pdl)
    gpu = device == "cuda"
    started = time.perf_counter()
    cases = []
    for stack in args.stacks.split(","):
        layers = step_layers(shapes[stack], rank, device, dtype)
        cases += [step_case(stack, shapes[stack], b, layers, device, dtype) for b in batches]
    base = {(c.stack, c.batch): step_graph_us(c.body(None), args.replays)[0] if gpu else None for c in cases}
    segments = {(c.stack, c.batch): step_graph_us(c.body(SEGMENTS), args.replays)[0] - base[(c.stack, c.batch)]
                if gpu else None for c in cases}
    results = {(c.stack, c.batch): {} for c in cases}
    for name in names:
        for c in cases:
            results[(c.stack, c.batch)][name] = step_variant(c, name, base[(c.stack, c.batch)], args.replays)
    groups = []
    for c in cases:
        shape, key = c.shape, (c.stack, c.batch)
        seg_grid = lora_triton.tile_grid(c.index.shape[0], shape.per, ADAPTERS + 1)
        picks = {linear: lora_triton.choose(c.x.shape[0], k, rank, outs, seg_grid, c.x.element_size())
                 for linear, k, outs in (("qkv", shape.k, shape.outs), ("o", shape.outs[0], (shape.o_out,)))}
        groups.append({"stack": c.stack, "batch": c.batch, "rows": c.x.shape[0], "rows_per_index": shape.per,
                       "index_entries": c.index.shape[0], "adapters_in_use": len(set(c.index.tolist())),
                       "grid": seg_grid, "layers": shape.layers, "evals": shape.evals, "lora_ops": shape.ops(),
                       "step_lora_ops": shape.ops(shape.step_layers), "k": shape.k, "outs": list(shape.outs),
                       "o_out": shape.o_out, "default_picks": {k: v._asdict() for k, v in picks.items()},
                       "base_us": base[key], "segment_rows_us": segments[key], "variants": results[key]})
    report = {"mode": "step", "device": torch.cuda.get_device_name() if gpu else "cpu (Triton interpreter)",
              "sms": lora_triton.sm_count(torch.device(device)),
              "date": datetime.now(UTC).isoformat(timespec="seconds"), "command": " ".join(sys.argv),
              "git_commit": git_commit(), "dtype": str(dtype).removeprefix("torch."),
              "rank": rank, "adapters": ADAPTERS, "tiny": args.tiny, "replays": args.replays,
              "small_variant": lora_triton.SMALL_VARIANT, "large_variant": lora_triton.LARGE_VARIANT,
              "variants": {n: lora_triton.VARIANTS[n]._asdict() for n in names if n != DEFAULT},
              "step_ms_no_lora": STEP_MS_NO_LORA, "groups": groups, "projection": step_projection(groups, names),
              "kernels": kernel_resources() if gpu else [], "seconds": time.perf_counter() - started}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    print_step(report, names)
    bad = [(g["stack"], g["batch"], n, r) for g in groups for n, r in g["variants"].items() if not step_good(r)]
    if bad:
        sys.exit(f"{len(bad)} step variants failed, differ from the torch reference or are not bit-reproducible: "
                 f"{bad[:3]}")


def step_projection(groups: list[dict], names: list[str]) -> dict:
    """Per batch: a whole step's LoRA overhead (us per op x the step's ops, over the stacks measured) with each
    variant everywhere and with each stack's fastest, in ms and as % of the no-LoRA step measured on the H200."""
    out: dict = {}
    for batch in sorted({g["batch"] for g in groups}):
        mine = [g for g in groups if g["batch"] == batch and g["base_us"] is not None]
        if not mine:
            continue
        ok = lambda g, n: step_good(g["variants"][n])  # noqa: E731
        ms = {n: sum(g["variants"][n]["us_per_op"] * g["step_lora_ops"] for g in mine) / 1e3
              for n in names if all(ok(g, n) for g in mine)}
        best = {g["stack"]: min((n for n in names if ok(g, n)), key=lambda n, g=g: g["variants"][n]["us_per_op"])
                for g in mine if any(ok(g, n) for n in names)}
        best_ms = sum(g["variants"][best[g["stack"]]]["us_per_op"] * g["step_lora_ops"] for g in mine
                      if g["stack"] in best) / 1e3
        step = STEP_MS_NO_LORA.get(batch)
        out[str(batch)] = {"stacks": [g["stack"] for g in mine], "ms": ms, "best": best, "best_ms": best_ms,
                           "step_ms_no_lora": step,
                           "pct": {n: 100 * v / step for n, v in ms.items()} if step else None,
                           "best_pct": 100 * best_ms / step if step else None}
    return out


def step_good(r: dict) -> bool:
    """A variant's result ran, matched the reference and replayed to the same bits."""
    return r["error"] is None and r["max_rel_err"] <= STEP_TOLERANCE and r["reproducible"] is not False


def step_cell(r: dict) -> str:
    """us per op (+ graph overhead %), '!' when the check or the reproducibility failed."""
    if r["error"]:
        return "FAILED"
    return f"{'' if step_good(r) else '!'}{r['us_per_op']:.1f} (+{r['overhead_pct']:.0f}%)"


def print_step(report: dict, names: list[str]) -> None:
    groups = report["groups"]
    if report["device"].startswith("cpu"):
        print(f"{report['device']}: --step checks only, times mean nothing")
        for g in groups:
            errs = ", ".join(f"{n} FAILED {r['error'][:300]}" if r["error"] else f"{n} {r['max_rel_err']:.1e}"
                             for n, r in g["variants"].items())
            print(f"{g['stack']} c={g['batch']} ({g['rows']} rows): rel err {errs}")
        return
    print(f"{report['device']}, {report['sms']} SMs, {report['dtype']}, rank {report['rank']}, {report['adapters']} "
          f"adapters; one CUDA graph per stack x batch x variant (median of {report['replays']} replays); cells: us "
          "per LoRA op = (graph - base graph) / ops, (+ the graph's overhead %); ! = wrong or not reproducible")
    row = lambda label, cells: print(f"{label:<14}" + "".join(f"{c:>18}" for c in cells))  # noqa: E731
    row("", [f"{g['stack']} c={g['batch']}" for g in groups])
    row("rows/grid/ops", [f"{g['rows']}/{g['grid']}/{g['lora_ops']}" for g in groups])
    row("base graph us", [f"{g['base_us']:.0f}" for g in groups])
    row("segments us", [f"+{g['segment_rows_us']:.1f}" for g in groups])  # once per graph, in every variant's
    for name in names:
        row(name, [step_cell(g["variants"][name]) for g in groups])
    row("fastest", [min((n for n in names if n != DEFAULT and step_good(g["variants"][n])), default="-",
                        key=lambda n, g=g: g["variants"][n]["us_per_op"]) for g in groups])
    for batch, p in report["projection"].items():
        pct = lambda n, p=p: f" ({p['pct'][n]:.1f}%)" if p["pct"] and n in p["pct"] else ""  # noqa: E731
        forced = sorted(((n, ms) for n, ms in p["ms"].items() if n != DEFAULT), key=lambda kv: kv[1])
        fastest = ", ".join(f"{n} {ms:.2f}{pct(n)}" for n, ms in forced[:3])
        where = f" of the {p['step_ms_no_lora']} ms no-LoRA step" if p["step_ms_no_lora"] else ""
        best = f" ({p['best_pct']:.1f}%)" if p["best_pct"] is not None else ""
        print(f"c={batch}: step LoRA overhead, ms{where} (us per op x {'/'.join(p['stacks'])} step ops): "
              f"best per stack {p['best_ms']:.2f}{best} {p['best']}; everywhere: {fastest}"
              + (f"; default {p['ms'][DEFAULT]:.2f}{pct(DEFAULT)}" if DEFAULT in p["ms"] else ""))
    print(f"defaults now: SMALL_VARIANT={report['small_variant']} (where fuse() allows one launch), "
          f"LARGE_VARIANT={report['large_variant']}; {report['seconds']:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the JSON here")
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--tiny", action="store_true", help="small shapes; on CPU in Triton's interpreter")
    parser.add_argument("--fused-tiles", default="64x128",
                        help="other BLOCK_N x BLOCK_K of the one-launch kernel to time besides the module's, "
                             "comma-separated (default: %(default)s)")
    parser.add_argument("--step", action="store_true", help="whole steps' LoRA'd linears in one graph per variant")
    parser.add_argument("--batches", default=None,
                        help=f"--step: sequences per step, comma-separated (default: {STEP_BATCHES}; "
                             f"--tiny: {TINY_STEP_BATCHES})")
    parser.add_argument("--variants", default=None,
                        help="--step: VARIANTS names to time, comma-separated (default: all, and `default`)")
    parser.add_argument("--stacks", default="dit,lm", help="--step: stacks to run (default: %(default)s)")
    parser.add_argument("--replays", type=int, default=STEP_REPLAYS, help="--step: timed graph replays")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.tiny:
        sys.exit("no GPU: run with --tiny (Triton's interpreter, small shapes)")
    if device == "cpu":
        torch.set_num_threads(1)
    rank = 4 if args.tiny else args.rank
    # the engine's dtype; Triton's interpreter mis-computes tl.dot on bf16 (numpy has none), so fp16 there
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    (step_main if args.step else kernels_main)(args, device, dtype, rank)


def kernels_main(args: argparse.Namespace, device: str, dtype: torch.dtype, rank: int) -> None:
    """The default mode: each linear alone, every path, in a graph of REPEAT calls."""
    own = f"{lora_triton.FUSED_BLOCK_N}x{lora_triton.FUSED_BLOCK_K}"  # first: the one lora_add_ runs
    tiles = list(dict.fromkeys([own, *filter(None, args.fused_tiles.split(","))]))
    shapes, row_counts = (TINY_SHAPES, TINY_ROWS) if args.tiny else (SHAPES, ROWS)
    results = [run_case(name, k, outs, rank, rows, adapters, device, dtype, tiles)
               for name, (k, outs) in shapes.items() for rows in row_counts[name.split()[0]]
               for adapters in (0, 1, ADAPTERS)]
    sms = lora_triton.sm_count(torch.device(device))
    report = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu (Triton interpreter)",
              "sms": sms, "date": datetime.now(UTC).isoformat(timespec="seconds"), "command": " ".join(sys.argv),
              "git_commit": git_commit(), "dtype": str(dtype).removeprefix("torch."), "repeat": REPEAT,
              "tiny": args.tiny,
              "fused_tiles": tiles, "fused_max_bytes": lora_triton.FUSED_MAX_BYTES, "results": results,
              "step_us": {f"c={c} adapters={n}": step_estimate(results, c, n)
                          for c in CONCURRENCY for n in (0, 1, ADAPTERS)},
              "step_us_two_launches": {f"c={c} adapters={n}": step_estimate(results, c, n, "two_launch_us")
                                       for c in CONCURRENCY for n in (0, 1, ADAPTERS)}}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"{report['device']}, {sms} SMs, {report['dtype']}, rank {rank}; us per call, median of CUDA-graph "
          f"replays of {REPEAT} calls" if device == "cuda" else f"{report['device']}: checks only, times mean nothing")
    print("2-launch: shrink + expand; 1-launch NxK: the fused kernel at BLOCK_N x BLOCK_K; pick: what lora_add_ runs; "
          "abs err: of the delta, 1-launch the worst tiles")
    print(f"{'shape':<8}{'rows':>6}{'per':>4}{'adapt':>6}{'grid':>5}{'split':>6}{'pick':>5}{'2-launch':>9}"
          + "".join(f"{'1@' + t:>10}" for t in tiles)
          + f"{'gemm us':>9}{'seg us':>8}{'abs err 2':>10}{'abs err 1':>10}")
    for r in results:
        print(f"{r['shape']:<8}{r['rows']:>6}{r['rows_per_index']:>4}{r['adapters']:>6}{r['grid']:>5}"
              f"{r['splits']:>6}{'1' if r['one_launch_picked'] else '2':>5}{r['two_launch_us']:>9.1f}"
              + "".join(f"{r['one_launch_us'][t]:>10.1f}" for t in tiles)
              + f"{r['base_gemm_us']:>9.1f}{r['segment_rows_us']:>8.1f}{r['two_launch_max_abs_err']:>10.1e}"
              f"{max(r['one_launch_max_abs_err'].values()):>10.1e}")
    for key, us in report["step_us"].items():
        two = report["step_us_two_launches"][key]
        if us is not None and two is not None and device == "cuda":
            print(f"LoRA kernels per decode step, {key}: {us / 1e3:.2f} ms (two launches everywhere: "
                  f"{two / 1e3:.2f} ms)")
    bad = [r for r in results if r["max_rel_err"] > 2e-2 or not r["delta_as_expected"]]
    if bad:
        sys.exit(f"{len(bad)} cases differ from the torch reference (or left y unchanged with adapters): {bad[:3]}")


if __name__ == "__main__":
    main()
