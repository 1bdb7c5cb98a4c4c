"""`engine.cuda_graphs.StepGraphs` on CUDA: two graph sets replayed side by side on two streams (the VAE lane's
graphs beside the step graphs) keep their GEMMs' results when each set was captured on a stream of its own.

Run on the GPU machine: `.venv/bin/python -m pytest -q -m gpu tests/gpu/test_cuda_graphs_gpu.py`.
"""

from __future__ import annotations

import pytest
import torch

from engine.cuda_graphs import StepGraphs

pytestmark = pytest.mark.gpu


def test_graph_sets_captured_on_streams_of_their_own_replay_side_by_side(cuda):
    """Graphs captured on one capture stream share the cuBLAS workspace PyTorch keys by that stream; two of them
    running at once then corrupt each other's split-K GEMMs. Captured apart (`StepGraphs(stream=)`), the two sets run
    at once, replay after replay, and each gives the bits of its first replay."""
    gen = torch.Generator(device=cuda).manual_seed(0)
    # few rows over a long K: the shapes for which cuBLAS splits K and reduces the parts through its workspace
    x = torch.randn(16, 65536, device=cuda, generator=gen)
    w = torch.randn(65536, 64, device=cuda, generator=gen)
    v = torch.randn(65536, 32, device=cuda, generator=gen)
    lane = torch.cuda.Stream()
    step = StepGraphs(lambda rows: [x[:rows] @ w for _ in range(8)], [16], lambda rows: None,
                      torch.cuda.graph_pool_handle())
    beside = StepGraphs(lambda rows: [x[:rows] @ v for _ in range(8)], [16], lambda rows: None,
                        torch.cuda.graph_pool_handle(), stream=lane)
    main = torch.cuda.current_stream()

    def replay_side_by_side() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        lane.wait_stream(main)
        with torch.cuda.stream(lane):
            lane_out = beside.replay(16)
        main_out = step.replay(16)
        main.wait_stream(lane)
        return [t.clone() for t in main_out], [t.clone() for t in lane_out]

    first_main, first_lane = replay_side_by_side()
    torch.cuda.synchronize()
    assert torch.allclose(first_main[0], x @ w, rtol=1e-3, atol=1e-1)  # the GEMM itself (TF32 or not)
    for _ in range(50):
        got_main, got_lane = replay_side_by_side()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(got_main, first_main, strict=True))
        assert all(torch.equal(a, b) for a, b in zip(got_lane, first_lane, strict=True))
