"""Continuations' VAE priming in batches (`VaeLane.prime`): a step that admits many continuations replays their
prompt tails in one decode per length and per PRIME_ROWS, padded with the scratch row; each row must come out as if
primed alone, and rows not primed must not move."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from engine.config import ModelConfig
from engine.model.audio_vae import AudioVAE
from engine.model_configs import tiny
from engine.runner.vae_lane import PRIME_ROWS, VaeLane


def _lane(vae: AudioVAE, config: ModelConfig, rows: int) -> VaeLane:
    return VaeLane(vae, torch.device("cpu"), rows, config.patch_size, vae.latent_dim, lane=False)


def test_batched_priming_equals_priming_each_alone():
    torch.manual_seed(0)
    config = ModelConfig.from_dict(tiny("voxcpm2"))
    vae = AudioVAE(config.audio_vae).eval()
    p, d = config.patch_size, vae.latent_dim
    rows = PRIME_ROWS + 8
    lengths = [3] * (PRIME_ROWS + 3) + [2, 1, 2]  # more of one length than one decode primes, and other lengths
    reqs = [SimpleNamespace(vae_slot=i, vae_primed=False, context_patches=torch.randn(k, p, d))
            for i, k in enumerate(lengths)]
    bystander = len(reqs)  # a row mid-stream, not primed now
    batched, alone = _lane(vae, config, rows), _lane(vae, config, rows)
    with torch.inference_mode():
        for lane in (batched, alone):
            lane.decode(torch.tensor([bystander]), torch.randn(1, p, d, generator=torch.Generator().manual_seed(1)))
        batched.prime(reqs)
        for req in reqs:
            alone.state.reset_(torch.tensor([req.vae_slot]))
            alone.prime_contexts([req.vae_slot], [req.context_patches])
        assert all(r.vae_primed for r in reqs)
        slots = torch.tensor([r.vae_slot for r in reqs] + [bystander])
        nxt = torch.randn(len(slots), p, d)
        got, want = batched.decode(slots, nxt), alone.decode(slots, nxt)
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5
