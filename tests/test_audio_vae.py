"""AudioVAE v1/v2 against the official voxcpm modules, and the batched streaming decoder against offline decode."""

import pytest
import torch

from engine.config import ModelConfig
from engine.model.audio_vae import AudioVAE, StreamState, fold_weight_norm
from engine.model_configs import tiny, voxcpm05b, voxcpm2, voxcpm15

ARCHS = ["voxcpm", "voxcpm2"]


def official_vae(config_dict: dict) -> torch.nn.Module:
    # Imported here: the GPU machine runs the gpu test without the oracle's dependencies (pydantic).
    from voxcpm.modules.audiovae import AudioVAE as OfficialV1
    from voxcpm.modules.audiovae import AudioVAEConfig as OfficialV1Config
    from voxcpm.modules.audiovae import AudioVAEConfigV2 as OfficialV2Config
    from voxcpm.modules.audiovae import AudioVAEV2 as OfficialV2

    vae = config_dict["audio_vae_config"]
    if config_dict["architecture"] == "voxcpm2":
        return OfficialV2(OfficialV2Config(**vae))
    return OfficialV1(OfficialV1Config(**vae))


def randomize_(module: torch.nn.Module) -> None:
    """Move every parameter off its default so a wrong fold, alpha or sample-rate bucket shows up."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("weight_g"):
                p.mul_(torch.empty_like(p).uniform_(0.5, 1.5))
            elif name.endswith("alpha"):
                p.uniform_(0.5, 2.0)
            elif name.endswith("scale_embed.weight"):
                p.normal_(1.0, 0.3)
            elif name.endswith("bias_embed.weight"):
                p.normal_(0.0, 0.3)


@pytest.fixture(scope="module", params=ARCHS)
def pair(request) -> tuple[torch.nn.Module, AudioVAE, int]:
    """(official VAE with random weights, ours loaded from it through fold_weight_norm + strict load, patch size)."""
    torch.manual_seed(0)
    config_dict = tiny(request.param)
    official = official_vae(config_dict).eval()
    randomize_(official)
    config = ModelConfig.from_dict(config_dict)
    ours = AudioVAE(config.audio_vae).eval()
    ours.load_state_dict(fold_weight_norm(official.state_dict()), strict=True)
    return official, ours, config.patch_size


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def test_encode_matches_official(pair):
    official, ours, _ = pair
    torch.manual_seed(1)
    for batch, length in [(1, 640), (2, 2000), (3, 5 * ours.encoder_hop + 17)]:
        audio = torch.randn(batch, 1, length) * 0.3
        with torch.no_grad():
            want = official.encode(audio, ours.sample_rate)
        got = ours.encode(audio)
        assert got.shape == (batch, ours.latent_dim, -(-length // ours.encoder_hop)) == want.shape
        assert rel_err(got, want) < 1e-5
    assert torch.equal(ours.encode(audio[:, 0]), got)  # [B, T] is accepted as mono


def test_decode_matches_official(pair):
    official, ours, _ = pair
    torch.manual_seed(2)
    for batch, frames in [(1, 1), (2, 7), (3, 25)]:
        latents = torch.randn(batch, ours.latent_dim, frames)
        with torch.no_grad():
            want = official.decode(latents)
        got = ours.decode(latents)
        assert got.shape == (batch, 1, frames * ours.decoder_hop) == want.shape
        assert got.abs().max() > 0.05  # not a saturated or silent output
        assert rel_err(got, want) < 1e-5


def decode_in_chunks(vae: AudioVAE, latents: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    assert sum(sizes) == latents.shape[-1]
    state = vae.stream_state(latents.shape[0])
    bounds = torch.tensor([0, *sizes]).cumsum(0).tolist()
    spans = zip(bounds, bounds[1:], strict=False)
    return torch.cat([vae.decode_stream(latents[..., a:b], state) for a, b in spans], dim=-1)


def test_streaming_equals_offline_for_any_chunking(pair):
    _, ours, patch = pair
    torch.manual_seed(3)
    frames = 6 * patch  # longer than the decoder's first-layer context, so the history really wraps
    latents = torch.randn(2, ours.latent_dim, frames)
    offline = ours.decode(latents)
    for sizes in ([1] * frames, [patch] * 6, [3, 1, 5, 2, frames - 11]):
        assert rel_err(decode_in_chunks(ours, latents, sizes), offline) < 1e-5, sizes


def test_streams_at_different_points_batch_like_alone(pair):
    """Three slots of one big state, advanced alone by different amounts, then decoded together, equal each alone."""
    _, ours, patch = pair
    torch.manual_seed(4)
    ahead = [0, 1, 3]  # patches each stream has already decoded alone
    total = 3 + max(ahead)
    latents = torch.randn(3, ours.latent_dim, total * patch)
    state = ours.stream_state(5)  # more slots than streams, like the serving engine
    slots = torch.tensor([4, 0, 2])
    chunks: list[list[torch.Tensor]] = [[] for _ in range(3)]
    for i, n in enumerate(ahead):
        slot = slots[i:i + 1]
        own = state.gather(slot)
        for p in range(n):
            chunks[i].append(ours.decode_stream(latents[i:i + 1, :, p * patch:(p + 1) * patch], own)[0])
        state.scatter_(slot, own)
    for step in range(3):
        rows = [latents[i, :, (n + step) * patch:(n + step + 1) * patch] for i, n in enumerate(ahead)]
        batch_state = state.gather(slots)
        out = ours.decode_stream(torch.stack(rows), batch_state)
        state.scatter_(slots, batch_state)
        for i in range(3):
            chunks[i].append(out[i])
    for i, n in enumerate(ahead):
        alone = ours.decode(latents[i:i + 1, :, :(n + 3) * patch])[0]
        assert rel_err(torch.cat(chunks[i], dim=-1), alone) < 1e-5, i


def test_gather_scatter_reset(pair):
    _, ours, patch = pair
    torch.manual_seed(5)
    state = ours.stream_state(4)
    ours.decode_stream(torch.randn(4, ours.latent_dim, 2 * patch), state)
    assert all(b.abs().sum() > 0 for b in state.buffers)

    index = torch.tensor([3, 1])
    part = state.gather(index)
    assert part.batch == 2 and all(torch.equal(p, b[index]) for p, b in zip(part.buffers, state.buffers, strict=True))
    copy = ours.stream_state(4)
    copy.scatter_(index, part)
    for c, b in zip(copy.buffers, state.buffers, strict=True):
        assert torch.equal(c[index], b[index]) and not c[[0, 2]].any()

    before = [b.clone() for b in state.buffers]
    state.reset_(torch.tensor([1]))
    for b, old in zip(state.buffers, before, strict=True):
        assert not b[1].any() and torch.equal(b[[0, 2, 3]], old[[0, 2, 3]])

    # After a reset the slot decodes like a fresh stream, while its neighbours continue their own history.
    fresh = torch.randn(4, ours.latent_dim, patch)
    out = ours.decode_stream(fresh, state)
    assert rel_err(out[1:2], ours.decode(fresh[1:2])) < 1e-5
    assert rel_err(out[0:1], ours.decode(fresh[0:1])) > 1e-3  # slot 0 still hears its past


def test_matches_official_v2_streaming_decode():
    torch.manual_seed(6)
    config_dict = tiny("voxcpm2")
    official = official_vae(config_dict).eval()
    randomize_(official)
    ours = AudioVAE(ModelConfig.from_dict(config_dict).audio_vae).eval()
    ours.load_state_dict(fold_weight_norm(official.state_dict()), strict=True)
    patch, latents = 4, torch.randn(1, 64, 20)
    state = ours.stream_state(1)
    with torch.no_grad(), official.streaming_decode() as dec:
        for p in range(0, latents.shape[-1], patch):
            chunk = latents[..., p:p + patch]
            assert rel_err(ours.decode_stream(chunk, state), dec.decode_chunk(chunk)) < 1e-5


@pytest.mark.parametrize("release, millions", [(voxcpm2, 94.2), (voxcpm15, 86.5), (voxcpm05b, 75.4)])
def test_release_parameter_counts(release, millions):
    """The published VAE sizes count the unfolded checkpoint: one weight_g entry per output row of each conv."""
    config_dict = release()
    with torch.device("meta"):
        ours = AudioVAE(ModelConfig.from_dict(config_dict).audio_vae)
        official = official_vae(config_dict)
    folded = sum(p.numel() for p in ours.parameters())
    g_entries = sum(m.weight.shape[0] for m in ours.modules() if isinstance(m, torch.nn.modules.conv._ConvNd))
    assert folded + g_entries == sum(p.numel() for p in official.parameters())
    assert round((folded + g_entries) / 1e6, 1) == millions
    assert set(ours.state_dict()) == set(fold_weight_norm(official.state_dict()))


def test_fold_weight_norm_both_spellings_and_pure():
    torch.manual_seed(7)
    old = torch.nn.utils.weight_norm(torch.nn.ConvTranspose1d(6, 3, 4, stride=2))
    new = torch.nn.utils.parametrizations.weight_norm(torch.nn.Conv1d(3, 5, 3))
    with torch.no_grad():
        old.weight_g.mul_(2.5)
        new.parametrizations.weight.original0.mul_(0.5)
    for module in (old, new):
        state = module.state_dict()
        keys = list(state)
        folded = fold_weight_norm(state)
        assert list(state) == keys  # input untouched
        assert set(folded) == {"weight", "bias"}
        module(torch.randn(1, module.in_channels, 4))  # old-style weight norm recomputes .weight on forward
        assert torch.allclose(folded["weight"], module.weight.detach(), rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="weight_v"):
        fold_weight_norm({"conv.weight_g": torch.ones(2, 1, 1)})


def test_bad_input_is_a_clear_error():
    vae = AudioVAE(ModelConfig.from_dict(tiny("voxcpm2")).audio_vae)
    with pytest.raises(ValueError, match="mono"):
        vae.encode(torch.zeros(1, 2, 640))
    with pytest.raises(ValueError, match="latents"):
        vae.decode(torch.zeros(1, 32, 4))
    with pytest.raises(ValueError, match="latents"):
        vae.decode(torch.zeros(1, 64, 0))
    with pytest.raises(ValueError, match="streams"):
        vae.decode_stream(torch.zeros(2, 64, 4), vae.stream_state(3))
    other = AudioVAE(ModelConfig.from_dict(tiny("voxcpm")).audio_vae)
    with pytest.raises(ValueError, match="buffers"):
        vae.decode_stream(torch.zeros(1, 64, 4), other.stream_state(1))
    with pytest.raises(ValueError, match="bfloat16"):
        vae.decode_stream(torch.zeros(1, 64, 4), vae.stream_state(1, dtype=torch.bfloat16))
    assert isinstance(vae.stream_state(1), StreamState)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ARCHS)
def test_decode_stream_replays_in_a_cuda_graph(arch, monkeypatch):
    """The streaming step has fixed shapes and in-place state: capture once, replay per patch, equal offline.
    In exact fp32: with TF32 (cuDNN's default) the streaming and offline paths round differently (~3e-4 apart)."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    torch.manual_seed(8)
    config = ModelConfig.from_dict(tiny(arch))
    vae = AudioVAE(config.audio_vae).cuda().eval()
    patch, batch, steps = config.patch_size, 3, 5
    latents = torch.randn(batch, vae.latent_dim, steps * patch, device="cuda")
    state = vae.stream_state(batch)
    static_in = torch.zeros(batch, vae.latent_dim, patch, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        vae.decode_stream(static_in, state)  # warm-up (cuDNN autotune, allocator) outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = vae.decode_stream(static_in, state)
    state.reset_(torch.arange(batch, device="cuda"))
    chunks = []
    for p in range(steps):
        static_in.copy_(latents[..., p * patch:(p + 1) * patch])
        graph.replay()
        chunks.append(static_out.clone())
    assert rel_err(torch.cat(chunks, dim=-1), vae.decode(latents)) < 1e-4


@pytest.mark.parametrize("length,stride", [(1, 8), (4, 8), (7, 5), (3, 2)])
def test_transposed_conv_as_one_gemm_equals_conv_transpose1d(length, stride):
    """The CUDA path's GEMM + overlap-add form of the decoder's upsampling (used for few-frame inputs)."""
    from engine.model.audio_vae import conv_transpose_gemm

    gen = torch.Generator().manual_seed(length * stride)
    x = torch.randn(3, 6, length, generator=gen, dtype=torch.float64)
    w = torch.randn(6, 5, 2 * stride, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(conv_transpose_gemm(x, w, stride), torch.nn.functional.conv_transpose1d(x, w, None,
                                                                                                       stride))
