"""The streaming VAE: its lane on a second CUDA stream, decodes, and continuation priming."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch

from engine.cuda_graphs import DecodeResult


class VaeLane:
    """The streaming VAE (a part of `Runner`)."""

    @contextlib.contextmanager
    def _on_vae_lane(self, join: bool = False) -> Iterator[None]:
        """Run the enclosed VAE-state work on the VAE lane, after all work queued so far on the main stream (its
        tensors must be made inside, or outlive the lane's use of them); `join`: the main stream then waits for it.
        Without the lane, in place."""
        lane = self.vae_stream
        if lane is None or torch.cuda.current_stream(self.device) == lane:
            yield
            return
        main = torch.cuda.current_stream(self.device)
        lane.wait_stream(main)
        with torch.cuda.stream(lane):
            yield
        if join:
            main.wait_stream(lane)

    def _vae_body(self, rows: int) -> torch.Tensor:
        """The VAE lane's decode of the first `rows` rows of its static inputs (what its graphs capture)."""
        return self._vae_decode(self.vae_in_slots[:rows], self.vae_in[:rows])

    def _pad_vae(self, rows: int) -> None:
        self.vae_in[:rows].zero_()
        self.vae_in_slots[:rows].fill_(self.scratch_slot)

    def _lane_audio(self, rows: int, result: DecodeResult) -> DecodeResult:
        """`result` with its audio: the step's VAE decode queued on the VAE lane behind its patches (without the
        lane the graph made it already). The main stream waits only for the previous lane decode to have read its
        inputs, before their buffers take this step's: a step's LMs and LocDiT take far longer than a VAE decode,
        so it is long done."""
        if result.audio is not None:
            return result
        assert self.vae_stream is not None and self.vae_graphs is not None
        main = torch.cuda.current_stream(self.device)
        if self._vae_read is not None:
            main.wait_event(self._vae_read)
        self.vae_in[:rows].copy_(result.patches[:rows])
        self.vae_in_slots[:rows].copy_(self.inputs.vae_slots[:rows])
        self.vae_stream.wait_stream(main)
        with torch.cuda.stream(self.vae_stream):
            audio = self.vae_graphs.replay(rows)
            self._vae_read = torch.cuda.Event()
            self._vae_read.record()
        return DecodeResult(result.patches, result.stops, audio)

    def noise(self, req) -> torch.Tensor:
        """[D, P] from the request's own generator, so a request's noise never depends on its batch."""
        p = req.spec.params
        return torch.randn(self.config.feat_dim, self.config.patch_size, generator=req.generator) * p.temperature

    def decode_audio(self, reqs: list, patches: torch.Tensor) -> np.ndarray:
        """One patch of audio per request, through each request's row of the streaming VAE state."""
        self._prime([r for r in reqs if not r.vae_primed])
        with self._on_vae_lane(join=True):
            slots = torch.tensor([r.vae_slot for r in reqs], device=self.vae_state.buffers[0].device)
            return self._vae_decode(slots, patches).cpu().numpy()

    def _vae_decode(self, slots: torch.Tensor, patches: torch.Tensor) -> torch.Tensor:
        """[B, P, D] patches -> [B, samples] float32 audio, advancing the VAE state rows `slots`."""
        part = self.vae_state.gather(slots)
        latents = patches.to(self.vae_dtype).transpose(1, 2)  # [B, D, P]: P latent frames per patch
        audio = self.vae.decode_stream(latents, part)
        self.vae_state.scatter_(slots, part)
        return audio.reshape(patches.shape[0], -1).float()

    def _prime(self, reqs: list) -> None:
        """Start the requests' VAE rows from silence (one reset for all of them: a burst of new requests costs one
        launch per state buffer, not one per request), then replay each continuation's prompt tail into its row."""
        if not reqs:
            return
        dev = self.vae_state.buffers[0].device
        slots = torch.tensor([r.vae_slot for r in reqs])
        with self._on_vae_lane():  # in order with the lane's decodes, and the main stream never waits for it
            self.vae_state.reset_(slots.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else slots)
            for req in reqs:
                context = req.spec.context_patches
                if context is not None and len(context):
                    self._prime_context(req.vae_slot, context)
                req.vae_primed = True

    def _prime_context(self, slot: int, context: torch.Tensor) -> None:
        """Replay a continuation's prompt tail [k, P, D] into VAE row `slot` (its audio is the previous segment's)."""
        dev = self.vae_state.buffers[0].device
        rows = torch.full((1,), slot, device=dev)  # a fill on the device: a pageable copy would wait for the stream
        part = self.vae_state.gather(rows)
        if dev.type == "cuda":  # pinned, for the same reason
            context = context.pin_memory()
        latents = context.to(self.device, non_blocking=True).to(self.vae_dtype)
        latents = latents.reshape(1, -1, self.config.feat_dim).transpose(1, 2)
        self.vae.decode_stream(latents, part)
        self.vae_state.scatter_(rows, part)
