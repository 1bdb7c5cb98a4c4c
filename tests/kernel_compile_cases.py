"""Compile every Triton kernel of engine/ for the H200 (sm_90) on a machine without a GPU; prints a JSON report.

The CPU suite runs the kernels in Triton's interpreter, which never runs the compiler frontend (type checks, branch
merging, layouts): a kernel can pass every interpreter test and still fail to compile on the GPU. This script runs
the real launchers (engine.kernels, TritonAttention, lora_add_) on small CPU tensors with the widths of the released
models, in bf16 and fp32, and replaces each launch by what Triton would compile for sm_90: the argument types and
specializations its binder derives, the constexprs and the launch options (num_warps). So the cases follow the
launchers when they change (launchers that dispatch on the device, such as TritonAttention's RoPE + K/V store,
are called directly too). Every @triton.jit function found in engine/ must be launched here or called from a
launched kernel.

Run it with TRITON_INTERPRET=0 (tests/test_kernels_compile.py does, in a subprocess), with one argument: the dtype
set (`DTYPE_SETS`), "serving" (what the GPU runs by default: bf16 stacks, the fp32 VAE), "other" (fp32 stacks, the
bf16 VAE of --vae-dtype bfloat16) or "all". Output, one JSON object:
{"kernels": [...], "uncovered": [...], "results": [{"kernel", "case", "error" (None when it compiled)}]}.
"""

from __future__ import annotations

import ast
import importlib
import json
import multiprocessing
import os
import pkgutil
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("kernel_compile_cases.py compiles kernels: run it with TRITON_INTERPRET=0")

import torch  # noqa: E402
import triton  # noqa: E402
from triton import knobs  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import engine  # noqa: E402
from engine.config import ModelConfig, StackConfig  # noqa: E402
from engine.model import lora_triton  # noqa: E402
from engine.model.attention import AttentionMetadata  # noqa: E402
from engine.model.attention_triton import TritonAttention, rope_store_kv_  # noqa: E402
from engine.model_configs import voxcpm05b, voxcpm2, voxcpm15  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)  # H200
# dtype set -> (stack dtypes, VAE dtypes); "serving" and "other" split the compiles in two halves without overlap
DTYPE_SETS = {"serving": ((torch.bfloat16,), (torch.float32,)), "other": ((torch.float32,), (torch.bfloat16,)),
              "all": ((torch.bfloat16, torch.float32), (torch.bfloat16, torch.float32))}
MODELS = {"VoxCPM2": voxcpm2, "VoxCPM1.5": voxcpm15, "VoxCPM-0.5B": voxcpm05b}
BLOCK_SIZE = 16  # the engine's default KV page (Engine(block_size=16))
LORA_SLOTS = 5  # max_loras=4 plus slot 0
LORA_RANKS = (32, 8)  # the default max_lora_rank, and the official fine-tunes' default rank


@dataclass(frozen=True)
class Launch:
    """What Triton would compile for one launch: kernel (module, name), the case that launched it, and the
    compile inputs as JITFunction.run builds them (constexprs and attrs keyed by argument path)."""

    module: str
    name: str
    case: str
    signature: dict[str, str]
    constexprs: dict[Any, Any]
    attrs: dict[Any, Any]
    options: dict[str, Any]

    def named_constexprs(self) -> dict[str, Any]:
        names = getattr(importlib.import_module(self.module), self.name).arg_names
        return {names[path[0]]: value for path, value in self.constexprs.items()}

    def key(self) -> str:
        return repr((self.module, self.name, self.signature, sorted(self.constexprs.items(), key=str),
                     sorted(self.attrs.items(), key=str), sorted(self.options.items())))


class Recorder:
    """Stands in for JITFunction.run: binds the launch's arguments as Triton would for sm_90, records, launches
    nothing (returns None, which the launchers ignore)."""

    def __init__(self) -> None:
        self.backend = make_backend(TARGET)
        self.launches: list[Launch] = []
        self.case = ""
        self._binders: dict[int, Callable] = {}

    def run(self, fn: JITFunction, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
        kwargs["debug"] = kwargs.get("debug", fn.debug) or knobs.runtime.debug  # as JITFunction.run does
        kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
        binder = self._binders.setdefault(id(fn), create_function_from_signature(fn.signature, fn.params,
                                                                                 self.backend))
        bound, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = fn._pack_args(self.backend, kwargs, bound, specialization, options)
        self.launches.append(Launch(fn.fn.__module__, fn.fn.__name__, self.case, signature, constexprs, attrs,
                                    dict(options.__dict__)))


# ---- discovery --------------------------------------------------------------------------------------------------

def all_kernels() -> dict[tuple[str, str], JITFunction]:
    """Every @triton.jit function defined in the engine package, by (module, name)."""
    found = {}
    for info in pkgutil.walk_packages(engine.__path__, "engine."):
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            if isinstance(value, JITFunction) and value.fn.__module__ == info.name:
                found[(info.name, name)] = value
    return found


def callees(fn: JITFunction) -> set[tuple[str, str]]:
    """The @triton.jit functions fn's body calls by name (helpers compile as part of their caller)."""
    # every name, not only calls: a helper can be passed as a combine function (tl.reduce(x, 0, _add))
    names = {node.id for node in ast.walk(ast.parse(fn.src)) if isinstance(node, ast.Name)}
    return {(v.fn.__module__, v.fn.__name__) for n in names
            if isinstance(v := fn.fn.__globals__.get(n), JITFunction) and v is not fn}


def covered(launched: set[tuple[str, str]], kernels: dict[tuple[str, str], JITFunction]) -> set[tuple[str, str]]:
    seen, todo = set(), list(launched)
    while todo:
        key = todo.pop()
        if key not in seen:
            seen.add(key)
            todo.extend(callees(kernels[key]))
    return seen


# ---- launch cases: the real launchers on small CPU tensors of real widths ----------------------------------------

def lm_stacks(cfg: ModelConfig) -> dict[str, StackConfig]:
    return {"base LM": cfg.lm, "residual LM": cfg.residual_lm, "LocEnc": cfg.encoder_lm, "LocDiT": cfg.dit_lm}


def launch_norm_mlp_rope(stack: StackConfig, dtype: torch.dtype) -> None:
    """RMSNorm (alone and after a residual add), SiLU*mul, FP8 row quantization and RoPE at the stack's widths."""
    from engine import kernels

    heads, kv, d = stack.num_attention_heads, stack.num_key_value_heads, stack.head_dim
    weight = torch.ones(stack.hidden_size, dtype=dtype)
    kernels.rms_norm(torch.randn(3, stack.hidden_size, dtype=dtype), weight, stack.rms_norm_eps)
    x, h = (torch.randn(3, stack.hidden_size, dtype=dtype) for _ in range(2))
    kernels.add_rms_norm(x, h, weight, stack.rms_norm_eps)  # a residual add and the norm after it
    kernels.add_rms_norm(x, h, weight, stack.rms_norm_eps, 1.4 / 28 ** 0.5)  # with muP's branch scale
    kernels.silu_mul(torch.randn(3, 2 * stack.intermediate_size, dtype=dtype))
    kernels.quantize_rows_fp8(torch.randn(3, stack.hidden_size, dtype=dtype))  # FP8 prefill: q|k|v, o, gate|up in
    kernels.quantize_rows_fp8(torch.randn(3, stack.intermediate_size, dtype=dtype))  # down's input
    kernels.quantize_rows_fp8(torch.randn(3, 12288, dtype=dtype))  # wider than registers: the two-pass branch
    kernels.rms_norm_fp8(torch.randn(3, stack.hidden_size, dtype=dtype), weight, stack.rms_norm_eps)
    kernels.add_rms_norm_fp8(x, h, weight, stack.rms_norm_eps, 1.4 / 28 ** 0.5)  # the norms before FP8 GEMMs
    kernels.silu_mul_fp8(torch.randn(3, 2 * stack.intermediate_size, dtype=dtype))
    cos, sin = torch.randn(5, d), torch.randn(5, d)
    qkv = torch.randn(2, 5, heads + 2 * kv, d, dtype=dtype)  # fused qkv output: q|k heads rotated at once
    kernels.rope_(qkv[..., :heads + kv, :], cos, sin)
    kernels.rope_(torch.randn(5, heads, d, dtype=dtype), cos, sin)  # unfused q and k
    kernels.rope_(torch.randn(5, kv, d, dtype=dtype), cos, sin)


def launch_short_attention(stack: StackConfig, length: int, dtype: torch.dtype) -> None:
    """The LocEnc/LocDiT dense attention on views of one fused qkv output, as the stacks call it."""
    from engine.model.attention_triton import short_attention

    heads, kv, d = stack.num_attention_heads, stack.num_key_value_heads, stack.head_dim
    qkv = torch.randn(2, length, heads + 2 * kv, d, dtype=dtype)
    q, k, v = qkv[:, :, :heads], qkv[:, :, heads:heads + kv], qkv[:, :, heads + kv:]
    rope = (torch.randn(length, d), torch.randn(length, d))
    short_attention(q, k, v)
    short_attention(q, k, v, rope)  # RoPE in the kernel (CUDA path)
    if length > 4:  # the LocDiT's last layer: its last P tokens' outputs only
        short_attention(q, k, v, last=4)
        short_attention(q, k, v, rope, last=4)


def launch_attention(stack: StackConfig, dtype: torch.dtype) -> None:
    heads, kv, d = stack.num_attention_heads, stack.num_key_value_heads, stack.head_dim
    k_cache, v_cache = (torch.zeros(8, BLOCK_SIZE, kv, d, dtype=dtype) for _ in range(2))
    tables = [[0, 1], [2, 3]]
    for backend, query_lens, cached_lens in ((TritonAttention(), [20, 3], [0, 5]),  # prefill chunks
                                             (TritonAttention(rows_per_program=256), [20, 3], [0, 5]),  # a burst's
                                             (TritonAttention(), [1, 1], [20, 9]),  # decode, one KV split
                                             (TritonAttention(num_splits=4), [1, 1], [20, 9])):  # flash-decoding
        meta = AttentionMetadata.build(query_lens, cached_lens, tables, BLOCK_SIZE, "cpu")
        n = sum(query_lens)
        qkv = torch.randn(n, heads + 2 * kv, d, dtype=dtype)  # q, k, v are views of the fused qkv output
        backend(qkv[:, :heads], qkv[:, heads:heads + kv], qkv[:, heads + kv:], k_cache, v_cache, meta)
        # the RoPE + K/V store that TritonAttention runs on CUDA only (the stack's RoPE, or none: residual LM)
        rope = None if stack.no_rope else (torch.randn(n, d), torch.randn(n, d))
        rope_store_kv_(qkv[:, :heads], qkv[:, heads:heads + kv], qkv[:, heads + kv:], k_cache, v_cache,
                       meta.slot_mapping, rope)


def launch_lora(k: int, outs: tuple[int, ...], rank: int, dtype: torch.dtype) -> None:
    """Decode at c=1 (one row, K split 16 ways), a mixed batch (a full tile of a slot and partial ones, K split)
    and a prefill-sized one (enough tiles that K is not split), each on both paths (one launch, and shrink + expand),
    so each plan's argument specializations compile."""
    lora_a = torch.empty(LORA_SLOTS, rank * len(outs), k, dtype=dtype)
    lora_b = torch.empty(LORA_SLOTS, sum(outs), rank, dtype=dtype)
    for index in (torch.tensor([2]), torch.tensor([1] * 17 + [3, 0, 3]), torch.tensor([1] * 4200 + [3, 0, 3, 4])):
        rows = index.shape[0]  # nothing runs: empty tensors of the launch's shapes
        for fused in (True, False):
            lora_triton.lora_add_(torch.empty(rows, sum(outs), dtype=dtype), torch.empty(rows, k, dtype=dtype),
                                  lora_a, lora_b, index, 1, outs if len(outs) > 1 else None, fused=fused)


def launch_vae_residual_units(cfg: ModelConfig, dtype: torch.dtype) -> None:
    """The fused residual unit at every decoder stage's length for one patch (a few samples per row at the first
    stage, thousands at the last): offline, streaming with one program per row (history updated in place) and with
    several (history staged), dilations 1/3/9."""
    from engine.model import vae_triton

    length, channels = cfg.patch_size, cfg.audio_vae.decoder_dim
    for stride in cfg.audio_vae.decoder_rates:
        length, channels = length * stride, channels // 2
        x, alpha = torch.zeros(1, channels, length, dtype=dtype), torch.ones(1, channels, 1, dtype=dtype)
        bias = torch.zeros(channels, dtype=dtype)
        dw_weight, pw_weight = (torch.zeros(channels, n, k, dtype=dtype) for n, k in ((1, vae_triton.TAPS),
                                                                                       (channels, 1)))
        for dilation in (1, 3, 9):
            for history in (None, torch.zeros(1, channels, 6 * dilation, dtype=dtype)):
                vae_triton.residual_unit(x, alpha, dw_weight, bias, alpha, pw_weight, bias, dilation, history)
        # a block's first unit: the upsampling's unbiased output y[..., :n] read in place, its bias added on load
        xv = torch.zeros(1, channels, length + stride, dtype=dtype)[..., :length]
        for history in (None, torch.zeros(1, channels, 6, dtype=dtype)):
            vae_triton.residual_unit(xv, alpha, dw_weight, bias, alpha, pw_weight, bias, 1, history, in_bias=bias)


def launch_cases(recorder: Recorder, dtypes: str = "all") -> None:
    """Every launch case with the stack and VAE dtypes of `DTYPE_SETS[dtypes]`."""
    from engine import kernels

    stack_dtypes, vae_dtypes = DTYPE_SETS[dtypes]

    for model, make in MODELS.items():
        cfg = ModelConfig.from_dict(make())
        recorder.case = f"{model} snake fp32 (the VAE always runs in fp32)"
        kernels.snake(torch.randn(1, cfg.audio_vae.decoder_dim, 7), torch.ones(1, cfg.audio_vae.decoder_dim, 1))
        recorder.case = f"{model} snake fp32 after a sample-rate condition's affine"
        c = cfg.audio_vae.decoder_dim
        kernels.snake(torch.randn(1, c, 7), torch.ones(1, c, 1), (torch.ones(c), torch.zeros(c)))
        for dtype in stack_dtypes:
            dt = str(dtype).removeprefix("torch.")
            recorder.case = f"{model} CFG-Zero* Euler, LocDiT output {dt}"
            x = torch.randn(3, cfg.patch_size, cfg.feat_dim)
            kernels.cfg_zero_euler_(x, torch.randn(6, cfg.patch_size, cfg.feat_dim, dtype=dtype), torch.ones(3),
                                    torch.tensor([0.1, 0.0, 0.2]))  # each row its own Euler step
            for stack_name, stack in lm_stacks(cfg).items():
                recorder.case = f"{model} {stack_name} norm/MLP/RoPE {dt}"
                launch_norm_mlp_rope(stack, dtype)
                heads, kv, d, hidden = (stack.num_attention_heads, stack.num_key_value_heads, stack.head_dim,
                                        stack.hidden_size)
                for rank in LORA_RANKS:
                    recorder.case = f"{model} {stack_name} LoRA q|k|v and o, rank {rank}, {dt}"
                    launch_lora(hidden, (heads * d, kv * d, kv * d), rank, dtype)
                    launch_lora(heads * d, (hidden,), rank, dtype)
            for stack_name, stack in (("base LM", cfg.lm), ("residual LM", cfg.residual_lm)):
                recorder.case = f"{model} {stack_name} paged attention {dt} (head dim {stack.head_dim})"
                launch_attention(stack, dtype)
            for stack_name, stack, length in (("LocEnc", cfg.encoder_lm, cfg.patch_size + 1),
                                              ("LocDiT", cfg.dit_lm, 2 * cfg.patch_size + 3)):
                recorder.case = f"{model} {stack_name} short attention {dt} ({length} tokens)"
                launch_short_attention(stack, length, dtype)
    vae_model = ModelConfig.from_dict(voxcpm2())
    for dtype in vae_dtypes:  # the engine runs the VAE in fp32; bf16 is supported too
        recorder.case = f"VoxCPM2 AudioVAE fused residual units {str(dtype).removeprefix('torch.')}"
        launch_vae_residual_units(vae_model, dtype)


# ---- compile ----------------------------------------------------------------------------------------------------

_JOBS: list[Launch] = []


def compile_one(i: int) -> str | None:
    """None when _JOBS[i] compiles for sm_90, else the error (the end of its message)."""
    launch = _JOBS[i]
    fn = getattr(importlib.import_module(launch.module), launch.name)
    try:
        triton.compile(ASTSource(fn, launch.signature, launch.constexprs, launch.attrs), target=TARGET,
                       options=launch.options)
    except Exception as e:  # a report per kernel, whatever the compiler raised
        text = "".join(traceback.format_exception_only(e)).strip()
        return text[-3000:]
    return None


def main(dtypes: str) -> None:
    torch.set_num_threads(1)
    kernels = all_kernels()
    recorder = Recorder()
    JITFunction.run = lambda fn, *args, grid, warmup, **kw: recorder.run(fn, *args, grid=grid, warmup=warmup, **kw)
    with torch.no_grad():
        launch_cases(recorder, dtypes)
    unique: dict[str, Launch] = {}
    for launch in recorder.launches:  # the first case that needs each distinct compile names it
        unique.setdefault(launch.key(), launch)
    _JOBS.extend(unique.values())
    workers = int(os.environ.get("KERNEL_COMPILE_WORKERS", "2"))
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        errors = pool.map(compile_one, range(len(_JOBS)), chunksize=1)
    launched = {(launch.module, launch.name) for launch in _JOBS}
    uncovered = sorted(kernels.keys() - covered(launched, kernels))
    print(json.dumps({
        "kernels": [f"{m}.{n}" for m, n in sorted(kernels)],
        "uncovered": [f"{m}.{n}" for m, n in uncovered],
        "results": [{"kernel": f"{j.module}.{j.name}", "case": j.case,
                     "constexprs": j.named_constexprs(), "error": err}
                    for j, err in zip(_JOBS, errors, strict=True)],
    }))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "all")
