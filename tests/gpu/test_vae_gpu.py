"""The fused AudioVAE residual units (engine.model.vae_triton) on CUDA at real VoxCPM2 decoder sizes, random weights.

Batch 64, three consecutive 4-frame patches (160 ms each) decoded in streaming: the fused path must give the eager
path's audio and leave the same stream state; it must replay from a CUDA graph and compile nothing new for another
batch size. Per-patch times of both paths (graph replays) are printed (run with -s).

Run on the GPU machine: `python -m pytest -q -m gpu -s tests/gpu/test_vae_gpu.py`.
"""

from __future__ import annotations

import contextlib
import statistics

import pytest
import torch

from engine.config import ModelConfig
from engine.model import audio_vae, vae_triton
from engine.model.audio_vae import AudioVAE, StreamState
from engine.model_configs import voxcpm2

BATCH, PATCH, PATCHES = 64, 4, 3


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.fixture(scope="module")
def vae(cuda) -> AudioVAE:
    torch.manual_seed(0)
    model = AudioVAE(ModelConfig.from_dict(voxcpm2()).audio_vae).to(cuda).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("alpha"):
                p.uniform_(0.5, 2.0)  # off the all-ones init, so a wrong alpha shows up
    return model


@contextlib.contextmanager
def residual_path(fused: bool):
    previous = audio_vae.FUSED_DECODER
    audio_vae.FUSED_DECODER = fused
    try:
        yield
    finally:
        audio_vae.FUSED_DECODER = previous


def decode_patches(vae: AudioVAE, latents: torch.Tensor, fused: bool) -> tuple[torch.Tensor, StreamState]:
    state = vae.stream_state(latents.shape[0])
    with residual_path(fused):
        audio = [vae.decode_stream(latents[..., p * PATCH:(p + 1) * PATCH], state) for p in range(PATCHES)]
    return torch.cat(audio, dim=-1), state


def test_fused_matches_eager_at_voxcpm2_size(vae, cuda):
    latents = torch.randn(BATCH, vae.latent_dim, PATCHES * PATCH, device=cuda)
    # TF32 off on both sides: the eager 1x1 convs would otherwise run in TF32 (cuDNN's default) and the fused GEMM
    # in fp32 (cuBLAS's default), and the comparison would measure TF32, not the fusion.
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        eager, eager_state = decode_patches(vae, latents, fused=False)
        fused, fused_state = decode_patches(vae, latents, fused=True)
    err = rel_err(fused, eager)
    state_err = max(rel_err(f, e) for f, e in zip(fused_state.buffers, eager_state.buffers, strict=True))
    print(f"\nVoxCPM2 VAE, batch {BATCH}, {PATCHES} patches, fp32: fused vs eager relative error {err:.2e} "
          f"(audio), {state_err:.2e} (worst state buffer)")
    assert eager.abs().max() > 0 and (eager.abs() > 0.999).float().mean() < 0.5  # neither silent nor saturated
    assert err < 1e-4 and state_err < 1e-4
    default_err = rel_err(decode_patches(vae, latents, fused=True)[0], decode_patches(vae, latents, fused=False)[0])
    print(f"with torch's default TF32 settings: {default_err:.2e}")


def test_fused_replays_from_a_cuda_graph_and_new_batches_do_not_recompile(vae, cuda):
    latents = torch.randn(BATCH, vae.latent_dim, PATCHES * PATCH, device=cuda)
    want, _ = decode_patches(vae, latents, fused=True)
    compiled = sum(len(cache[0]) for cache in vae_triton._residual_unit_kernel.device_caches.values())
    decode_patches(vae, latents[:BATCH - 3], fused=True)  # another batch size: same specializations
    assert sum(len(cache[0]) for cache in vae_triton._residual_unit_kernel.device_caches.values()) == compiled

    state = vae.stream_state(BATCH)
    static_in = torch.zeros(BATCH, vae.latent_dim, PATCH, device=cuda)
    with residual_path(True):
        graph, static_out = capture(lambda: vae.decode_stream(static_in, state))
    state.reset_(torch.arange(BATCH, device=cuda))
    chunks = []
    for p in range(PATCHES):
        static_in.copy_(latents[..., p * PATCH:(p + 1) * PATCH])
        graph.replay()
        chunks.append(static_out.clone())
    assert rel_err(torch.cat(chunks, dim=-1), want) < 1e-6


def capture(fn):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # warm-up (Triton compile, cuDNN/cuBLAS choice, allocator) outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-2), (torch.bfloat16, 5e-2)], ids=["fp32", "bf16"])
def test_patch_times(vae, cuda, dtype, tolerance):
    """One streaming patch at batch 64 replayed from a CUDA graph, eager vs fused, with torch's default settings
    (the eager 1x1 convs in TF32): median times printed; both graphs, replayed alike, agree."""
    model = vae if dtype == torch.float32 else AudioVAE(vae.config).to(cuda, dtype).eval()
    if model is not vae:
        model.load_state_dict(vae.state_dict())
    latents = torch.randn(BATCH, model.latent_dim, PATCH, device=cuda, dtype=dtype)
    times, outputs = {}, {}
    for fused in (False, True):
        state = model.stream_state(BATCH)
        with residual_path(fused):
            graph, outputs[fused] = capture(lambda state=state: model.decode_stream(latents, state))
        times[fused] = replay_ms(graph)
    print(f"\nVoxCPM2 VAE patch decode, batch {BATCH}, {str(dtype).removeprefix('torch.')}: eager "
          f"{times[False]:.2f} ms, fused {times[True]:.2f} ms ({times[False] / times[True]:.2f}x)")
    assert rel_err(outputs[True], outputs[False]) < tolerance


def replay_ms(graph: torch.cuda.CUDAGraph, reps: int = 20) -> float:
    for _ in range(3):
        graph.replay()
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return statistics.median(samples)
