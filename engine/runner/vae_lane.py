"""The streaming VAE: one state row per request slot, its decodes, continuation priming, and its lane (a second CUDA
stream that decodes each step's patches beside the next step's LMs: `engine.runner`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch

from engine.cuda_graphs import DecodeResult, StepGraphs

# Continuations primed in one decode at most (a step admitting more takes several), and the batch sizes a priming is
# padded to: few shapes, each met by the warm-up, and a small transient (a row of 3 patches is ~23k samples deep).
PRIME_ROWS = 16
PRIME_BATCHES = (1, 2, 4, 8, 16)


class VaeLane:
    """The VAE state (a row per request slot, and a scratch row that padding rows decode into) and everything that
    touches it. With `lane` (CUDA graphs), the decodes, resets and primings run on a stream of their own, in the
    order of launch."""

    def __init__(self, vae: torch.nn.Module, device: torch.device, rows: int, patch_size: int, feat_dim: int,
                 lane: bool):
        self.vae, self.device, self.feat_dim = vae, device, feat_dim
        self.dtype = next(vae.decoder.parameters()).dtype
        self.scratch_slot = rows  # padding rows decode into this extra row
        self.state = vae.stream_state(rows + 1)
        self.stream = torch.cuda.Stream(device) if lane else None
        # the static inputs the lane's graphs read (each step's patches and VAE rows, copied there: the next step
        # overwrites its own), and the event of their last read
        self.inputs = torch.zeros(rows, patch_size, feat_dim, device=device)
        self.input_slots = torch.full((rows,), self.scratch_slot, dtype=torch.long, device=device)
        self.graphs: StepGraphs | None = None
        self._read: torch.cuda.Event | None = None

    def capture(self, buckets: list[int]) -> None:
        """The lane's graphs, one per row bucket: replayed beside the step graphs, not after them, so a memory pool
        and a capture stream of their own (their GEMMs get a cuBLAS workspace of their own, see `StepGraphs`; with
        one shared, steps launched ahead would sample wrong patches now and then)."""
        self.graphs = StepGraphs(self.body, buckets, self.pad, torch.cuda.graph_pool_handle(), stream=self.stream)

    @contextlib.contextmanager
    def on_lane(self, join: bool = False) -> Iterator[None]:
        """Run the enclosed VAE-state work on the lane, after all work queued so far on the main stream (its
        tensors must be made inside, or outlive the lane's use of them); `join`: the main stream then waits for it.
        Without the lane, in place."""
        lane = self.stream
        if lane is None or torch.cuda.current_stream(self.device) == lane:
            yield
            return
        main = torch.cuda.current_stream(self.device)
        lane.wait_stream(main)
        with torch.cuda.stream(lane):
            yield
        if join:
            main.wait_stream(lane)

    def body(self, rows: int) -> torch.Tensor:
        """The lane's decode of the first `rows` rows of its static inputs (what its graphs capture)."""
        return self.decode(self.input_slots[:rows], self.inputs[:rows])

    def pad(self, rows: int) -> None:
        self.inputs[:rows].zero_()
        self.input_slots[:rows].fill_(self.scratch_slot)

    def audio(self, rows: int, result: DecodeResult, slots: torch.Tensor) -> DecodeResult:
        """`result` with its audio: the step's decode of its patches into VAE rows `slots`, queued on the lane behind
        them (without the lane the step's graph made it already). The main stream waits only for the previous lane
        decode to have read its inputs, before their buffers take this step's: a step's LMs and LocDiT take far
        longer than a VAE decode, so it is long done."""
        if result.audio is not None:
            return result
        assert self.stream is not None and self.graphs is not None
        main = torch.cuda.current_stream(self.device)
        if self._read is not None:
            main.wait_event(self._read)
        self.inputs[:rows].copy_(result.patches[:rows])
        self.input_slots[:rows].copy_(slots[:rows])
        self.stream.wait_stream(main)
        with torch.cuda.stream(self.stream):
            audio = self.graphs.replay(rows)
            self._read = torch.cuda.Event()
            self._read.record()
        return DecodeResult(result.patches, result.stops, audio)

    def decode_audio(self, reqs: list, patches: torch.Tensor) -> np.ndarray:
        """One patch of audio per request, through each request's row of the streaming VAE state."""
        self.prime([r for r in reqs if not r.vae_primed])
        with self.on_lane(join=True):
            slots = torch.tensor([r.vae_slot for r in reqs], device=self.state.buffers[0].device)
            return self.decode(slots, patches).cpu().numpy()

    def decode(self, slots: torch.Tensor, patches: torch.Tensor) -> torch.Tensor:
        """[B, P, D] patches -> [B, samples] float32 audio, advancing the VAE state rows `slots`."""
        part = self.state.gather(slots)
        latents = patches.to(self.dtype).transpose(1, 2)  # [B, D, P]: P latent frames per patch
        audio = self.vae.decode_stream(latents, part)
        self.state.scatter_(slots, part)
        return audio.reshape(patches.shape[0], -1).float()

    def prime(self, reqs: list) -> None:
        """Start the requests' VAE rows from silence (one reset for all of them: a burst of new requests costs one
        launch per state buffer, not one per request), then replay the continuations' prompt tails into their rows,
        those of one length together (`prime_contexts`)."""
        if not reqs:
            return
        dev = self.state.buffers[0].device
        slots = torch.tensor([r.vae_slot for r in reqs])
        by_length: dict[int, list] = {}
        with self.on_lane():  # in order with the lane's decodes, and the main stream never waits for it
            self.state.reset_(slots.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else slots)
            for req in reqs:
                if len(req.context_patches):
                    by_length.setdefault(len(req.context_patches), []).append(req)
                req.vae_primed = True
            for group in by_length.values():
                for i in range(0, len(group), PRIME_ROWS):
                    part = group[i:i + PRIME_ROWS]
                    self.prime_contexts([r.vae_slot for r in part], [r.context_patches for r in part])

    def prime_contexts(self, slots: list[int], contexts: list[torch.Tensor]) -> None:
        """Replay continuations' prompt tails (each [k, P, D], one k) into VAE rows `slots` as one decode. Under load
        a step admits dozens of continuations (every later segment of a gateway turn is one): one eager decode each
        held the worker's host thread ~1 ms per request and queued as many decodes on the lane ahead of the step's
        own. The batch is padded to a power of two with the scratch row (`PRIME_BATCHES`, met by the warm-up)."""
        n = len(slots)
        padded = next(b for b in PRIME_BATCHES if b >= n)
        dev = self.state.buffers[0].device
        pinned = dev.type == "cuda"  # a pageable copy would wait for the stream
        rows = torch.full((padded,), self.scratch_slot, dtype=torch.long, pin_memory=pinned)
        rows[:n] = torch.tensor(slots, dtype=torch.long)
        latents = torch.zeros((padded, *contexts[0].shape), dtype=contexts[0].dtype, pin_memory=pinned)
        torch.stack(contexts, out=latents[:n])
        rows = rows.to(dev, non_blocking=True)
        part = self.state.gather(rows)
        latents = latents.to(self.device, non_blocking=True).to(self.dtype)
        self.vae.decode_stream(latents.reshape(padded, -1, self.feat_dim).transpose(1, 2), part)
        self.state.scatter_(rows, part)
