"""Runs one scheduled step on the device: flat LM batch -> patches -> stop flags -> streaming VAE.

The runner owns everything that lives on the device: the model, both paged KV caches (base and residual LM share
block tables), and one VAE stream state with a row per request slot. The paths:

- decode-only steps go through static buffers (`engine.cuda_graphs`): on CUDA one graph replay per step, no host
  sync but the one on the outputs; on CPU the same body runs eagerly at the exact batch;
- steps with prefill chunks run both LMs over the flat batch (a third graph set, keyed by tokens x sequences, when
  the step is small enough for launches to dominate; eagerly otherwise), then the emitting rows go through the
  second graph set, "sample + stop + VAE", over the same buffers.

Each row samples at its own settings on every path: its cfg_value and its Euler schedule (`timesteps`, up to the
served maximum `max_timesteps`) are rows of the static buffers, so a request's settings never change a step's
shape or path. The step runs the default timesteps' evaluations: a row with fewer rides along with dt = 0
(`engine.model.euler`); a row with more finishes its own in the step's tail (`engine.step_tail`), a graph per row
bucket over just those rows, replayed after the step's graph and before the VAE lane decodes.

`launch` starts a step and returns at once on the graph path (outputs come back D2H into pinned memory, behind a
CUDA event); `collect` waits for them. The worker publishes the previous step's audio in between.

The VAE lane (CUDA graphs): a step's streaming VAE decode is its own graph, replayed on a second CUDA stream as soon
as the step's patches exist, while the main stream goes on with the next step's LMs and LocDiT (which need only the
patches). The VAE's memory-bound convolutions then fill the SMs that the LocDiT's small kernels and GEMM tails
leave idle, instead of adding their time to every step. Everything that touches the VAE state (decodes, resets,
continuation priming) runs on that stream, so its order is the order of launch. `VOXGATE_VAE_STREAM=0`: the VAE
stays inside the step's graph, on the main stream (`WorkerConfig.vae_stream`).

On a GPU the KV cache takes what `gpu_memory_utilization` leaves after the weights, the static buffers, the
measured peak of a largest eager step and the graphs' memory pool (estimated by the largest decode step's peak).
"""

from engine.runner.records import PendingStep, StepOutput, StepTiming
from engine.runner.step import Runner
from engine.runner.warm_up import triton_compiles

__all__ = ["PendingStep", "Runner", "StepOutput", "StepTiming", "triton_compiles"]
