"""AudioVAE of the VoxCPM family (v1: VoxCPM-0.5B / 1.5, v2: VoxCPM2), with a batched stateful streaming decoder.

DAC-style and fully causal: every conv pads only on the left, every transposed conv only trims on the right. That
makes streaming exact: each causal conv keeps its last `context` input samples per stream, and each transposed conv
keeps the `stride` output samples that overlap the next chunk (the part the offline right-trim would drop). So the
concatenated chunks of `decode_stream` equal `decode` of the whole sequence for any chunking.

Weight norm is folded at load time (`fold_weight_norm`): parameter names equal the official ones with
`weight_g`/`weight_v` replaced by `weight`, so a folded official state_dict loads strictly.
"""

from __future__ import annotations

import bisect
import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.config import AudioVAEConfig
from engine.model.fusion import fused

# Every stateful layer reads and writes its own entry of this list (its `slot`); None means offline (zero history).
States = list[Tensor] | None

# None: the decoder takes its fused paths (Triton residual units, GEMM upsampling of short inputs) exactly when
# `fused(x)` (CUDA). Tests set True to run them on CPU under TRITON_INTERPRET=1 (or False to force the eager ones).
FUSED_DECODER: bool | None = None


@contextlib.contextmanager
def gemms_like_convs() -> Iterator[None]:
    """cuBLAS in TF32 exactly when cuDNN is (torch's default: cuDNN on, cuBLAS off), for the decoder's fused path:
    its GEMMs replace convs that cuDNN ran in TF32, so the numerics stay those of the eager decoder (fp32 GEMMs
    instead cost several ms more in a large step). The worker is one thread: the global flag is safe to flip."""
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous


def fused_decoder(x: Tensor) -> bool:
    """Whether the decoder takes its fused paths for x (`FUSED_DECODER`, default: on CUDA with fused kernels)."""
    return fused(x) if FUSED_DECODER is None else FUSED_DECODER


class Snake(nn.Module):
    """Snake activation x + sin(a x)^2 / a, one alpha per channel."""

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(1, channels, 1))

    def forward(self, x: Tensor, states: States = None, affine: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """`affine` (scale, shift) [C]: of x * scale + shift (a `SampleRateCondition` before it; one pass on CUDA)."""
        if fused(x):  # one fused pass instead of five kernels; triton comes with CUDA torch
            from engine.kernels import snake

            return snake(x, self.alpha, affine)
        if affine is not None:
            x = x * affine[0][:, None] + affine[1][:, None]
        return x + (self.alpha + 1e-9).reciprocal() * torch.sin(self.alpha * x).pow(2)


class CausalConv1d(nn.Conv1d):
    """Conv1d padded with `context` samples on the left: zeros offline, the stream's history when streaming."""

    def __init__(self, cin: int, cout: int, kernel: int, *, stride: int = 1, dilation: int = 1, groups: int = 1,
                 context: int | None = None):
        super().__init__(cin, cout, kernel, stride=stride, dilation=dilation, groups=groups)
        self.context = (kernel - 1) * dilation if context is None else context
        self.slot = -1  # index into the stream state, set by the decoder

    def forward(self, x: Tensor, states: States = None) -> Tensor:
        if self.context:
            if states is None:
                x = F.pad(x, (self.context, 0))
            else:
                history = states[self.slot]
                x = torch.cat([history, x], dim=-1)
                history.copy_(x[..., -self.context:])
        return F.conv1d(x, self.weight, self.bias, self.stride, 0, self.dilation, self.groups)


class CausalConvTranspose1d(nn.ConvTranspose1d):
    """Upsampling by `stride` (kernel 2*stride) that keeps output frame j depending on input frames j-1 and j only.

    The full transposed conv of L frames is (L+1)*stride long; the last `stride` samples belong to the next frame.
    Offline they are trimmed; streaming carries them (without bias) and adds them to the next chunk's head."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__(cin, cout, 2 * stride, stride=stride)
        self.slot = -1

    def forward(self, x: Tensor, states: States = None) -> Tensor:
        return self.unbiased(x, states) + self.bias[:, None]

    def unbiased(self, x: Tensor, states: States = None) -> Tensor:
        """The output before its bias, y[..., :n] of the untrimmed y: a strided view, for a consumer that adds the
        bias as it reads it (the fused decoder's first residual unit)."""
        s = self.stride[0]
        # A few wide frames (the first block sees a patch's 4 latent frames x 2048 channels): cuDNN picks a slow
        # fp32 kernel there (a large step's largest kernel); one GEMM of 69 GFLOP (TF32) instead.
        short = fused_decoder(x) and x.shape[-1] <= SHORT_TRANSPOSED_FRAMES
        y = conv_transpose_gemm(x, self.weight, s) if short else F.conv_transpose1d(x, self.weight, None, s)
        n = x.shape[-1] * s
        if states is not None:
            overlap = states[self.slot]
            y[..., :s] += overlap
            overlap.copy_(y[..., n:])
        return y[..., :n]


SHORT_TRANSPOSED_FRAMES = 8


def conv_transpose_gemm(x: Tensor, weight: Tensor, stride: int) -> Tensor:
    """F.conv_transpose1d(x, weight, None, stride) for kernel 2 * stride as one batched GEMM plus an overlap-add:
    x [B, Cin, L], weight [Cin, Cout, 2s] -> [B, Cout, (L + 1) s]. Frame j writes 2s samples from j*s on."""
    b, cin, length = x.shape
    cout, kernel = weight.shape[1:]
    if kernel != 2 * stride:
        raise ValueError(f"conv_transpose_gemm needs kernel 2 * stride (got {kernel}, {stride})")
    # [B*L, Cin] made contiguous first: matmul of the transposed 3-D view would run as a bmm over B with the weight
    # broadcast, re-reading all of it (134 MB fp32 in VoxCPM2's first block) once per stream: 9.4 ms at B=256
    frames = x.transpose(1, 2).reshape(b * length, cin) @ weight.reshape(cin, cout * kernel)  # [B*L, Cout * 2s]
    frames = frames.view(b, length, cout, kernel).permute(0, 2, 1, 3)  # [B, Cout, L, 2s]
    y = x.new_zeros(b, cout, length + 1, stride)
    y[:, :, :length] += frames[..., :stride]
    y[:, :, 1:] += frames[..., stride:]
    return y.view(b, cout, (length + 1) * stride)


class ResidualUnit(nn.Module):
    """x + conv1x1(snake(dilated depthwise conv k7(snake(x))))."""

    def __init__(self, dim: int, dilation: int):
        super().__init__()
        self.block = nn.ModuleList([
            Snake(dim), CausalConv1d(dim, dim, 7, dilation=dilation, groups=dim), Snake(dim), CausalConv1d(dim, dim, 1),
        ])

    def forward(self, x: Tensor, states: States = None, in_bias: Tensor | None = None) -> Tensor:
        """`in_bias` [C]: the unit runs on x + in_bias[:, None] (on the fused path added as its kernel loads x)."""
        if fused_decoder(x):
            return self._fused_forward(x, states, in_bias)
        if in_bias is not None:
            x = x + in_bias[:, None]
        y = x
        for layer in self.block:
            y = layer(y, states)
        return x + y

    def _fused_forward(self, x: Tensor, states: States, in_bias: Tensor | None) -> Tensor:
        # Two launches instead of seven: engine.model.vae_triton (triton comes with CUDA torch)
        from engine.model.vae_triton import residual_unit

        snake1, conv, snake2, pointwise = self.block
        history = None if states is None else states[conv.slot]
        return residual_unit(x, snake1.alpha, conv.weight, conv.bias, snake2.alpha, pointwise.weight, pointwise.bias,
                             conv.dilation[0], history, in_bias=in_bias)


def _residual_units(dim: int) -> list[nn.Module]:
    return [ResidualUnit(dim, dilation) for dilation in (1, 3, 9)]


class _Sequence(nn.Module):
    """Runs `self.block` in order, threading the stream state through."""

    block: nn.ModuleList

    def forward(self, x: Tensor, states: States = None) -> Tensor:
        for layer in self.block:
            x = layer(x, states)
        return x


class EncoderBlock(_Sequence):
    def __init__(self, dim: int, stride: int, version: int):
        super().__init__()
        # The official v1 conv pads 2*ceil(s/2) on the left, v2 subtracts its output_padding s % 2 (= s for both
        # parities); odd strides therefore align one sample differently in the two versions.
        context = 2 * math.ceil(stride / 2) - (stride % 2 if version == 2 else 0)
        self.block = nn.ModuleList([
            *_residual_units(dim), Snake(dim),
            CausalConv1d(dim, 2 * dim, 2 * stride, stride=stride, context=context),
        ])


class DecoderBlock(_Sequence):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.block = nn.ModuleList([Snake(cin), CausalConvTranspose1d(cin, cout, stride), *_residual_units(cout)])

    def forward(self, x: Tensor, states: States = None, affine: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """`affine`: a sample-rate condition's (scale, shift) for the first Snake to apply as it reads x."""
        snake, upsample, first, *rest = self.block
        x = snake(x, states, affine)
        if fused_decoder(x):
            # the upsampling's bias added by the first residual unit's kernel as it loads x, which it reads as a
            # view of the untrimmed output: a read and a write of the block's largest activation fewer
            x = first(upsample.unbiased(x, states), states, in_bias=upsample.bias)
        else:
            x = first(upsample(x, states), states)
        for layer in rest:
            x = layer(x, states)
        return x


class Encoder(nn.Module):
    def __init__(self, config: AudioVAEConfig):
        super().__init__()
        dim = config.encoder_dim
        layers: list[nn.Module] = [CausalConv1d(1, dim, 7)]
        for stride in config.encoder_rates:
            layers.append(EncoderBlock(dim, stride, config.version))
            dim *= 2
        self.block = nn.ModuleList(layers)
        self.fc_mu = CausalConv1d(dim, config.latent_dim, 3)
        self.fc_logvar = CausalConv1d(dim, config.latent_dim, 3)  # unused (encode returns the mean); kept for loading
        # the layers with history, for encoding in chunks (`AudioVAE.encode_stream`); fc_logvar never runs
        self.stateful = [m for m in [*self.block.modules(), self.fc_mu] if isinstance(m, CausalConv1d) and m.context]
        for slot, module in enumerate(self.stateful):
            module.slot = slot

    def forward(self, x: Tensor, states: States = None) -> Tensor:
        for layer in self.block:
            x = layer(x, states)
        return self.fc_mu(x, states)


class SampleRateCondition(nn.Module):
    """v2: per-channel scale and bias chosen by the output sample-rate bucket, before each decoder block."""

    def __init__(self, dim: int, buckets: int, out_layer: bool):
        super().__init__()
        self.scale_embed = nn.Embedding(buckets, dim)
        self.bias_embed = nn.Embedding(buckets, dim)
        nn.init.ones_(self.scale_embed.weight)
        nn.init.zeros_(self.bias_embed.weight)
        self.out_layer = nn.ModuleList([Snake(dim), CausalConv1d(dim, dim, 1)]) if out_layer else None

    def affine(self, bucket: int) -> tuple[Tensor, Tensor]:
        """(scale, shift) [C] of this bucket: views, no copy."""
        return self.scale_embed.weight[bucket], self.bias_embed.weight[bucket]

    def forward(self, x: Tensor, bucket: int) -> Tensor:
        scale, shift = self.affine(bucket)
        x = x * scale[:, None] + shift[:, None]
        if self.out_layer is not None:
            for layer in self.out_layer:
                x = layer(x)
        return x


class Decoder(nn.Module):
    def __init__(self, config: AudioVAEConfig):
        super().__init__()
        latent, channels = config.latent_dim, config.decoder_dim
        layers: list[nn.Module] = [CausalConv1d(latent, latent, 7, groups=latent), CausalConv1d(latent, channels, 1)]
        for i, stride in enumerate(config.decoder_rates):
            layers.append(DecoderBlock(channels >> i, channels >> (i + 1), stride))
        out_dim = channels >> len(config.decoder_rates)
        layers += [Snake(out_dim), CausalConv1d(out_dim, 1, 7)]
        self.model = nn.ModuleList(layers)
        self.sr_cond_model: nn.ModuleList | None = None
        self.bucket = 0
        if config.version == 2:
            boundaries = list(config.sr_bin_boundaries or ())
            self.register_buffer("sr_bin_boundaries", torch.tensor(boundaries, dtype=torch.int32))
            # torch.bucketize(right=False) == bisect_left; fixed per model, so no device sync in forward.
            self.bucket = bisect.bisect_left(boundaries, config.out_sample_rate)
            self.sr_cond_model = nn.ModuleList([
                SampleRateCondition(layer.block[0].alpha.shape[1], len(boundaries) + 1, config.cond_out_layer)
                if isinstance(layer, DecoderBlock) else None
                for layer in layers
            ])
        self.stateful = [m for m in self.modules() if isinstance(m, CausalConvTranspose1d)
                         or (isinstance(m, CausalConv1d) and m.context)]
        for slot, module in enumerate(self.stateful):
            module.slot = slot

    def state_shapes(self) -> list[tuple[int, int]]:
        """(channels, samples) of each stateful layer's per-stream history."""
        return [(m.out_channels, m.stride[0]) if isinstance(m, CausalConvTranspose1d) else (m.in_channels, m.context)
                for m in self.stateful]

    def forward(self, x: Tensor, states: States = None) -> Tensor:
        conds = self.sr_cond_model if self.sr_cond_model is not None else [None] * len(self.model)
        for layer, cond in zip(self.model, conds, strict=True):
            if cond is not None and cond.out_layer is None and fused_decoder(x):
                # the condition's x * scale + shift done by the block's first Snake as it reads x: two passes over
                # the activations fewer per block
                x = layer(x, states, cond.affine(self.bucket))
                continue
            if cond is not None:
                x = cond(x, self.bucket)
            x = layer(x, states)
        return torch.tanh(x)


@dataclass
class StreamState:
    """Decoder history of B streams: one tensor [B, C, samples] per stateful layer, updated in place."""

    buffers: list[Tensor]

    @property
    def batch(self) -> int:
        return self.buffers[0].shape[0]

    def gather(self, index: Tensor) -> StreamState:
        """A new state holding the rows `index` (copies)."""
        return StreamState([b.index_select(0, index) for b in self.buffers])

    def scatter_(self, index: Tensor, part: StreamState) -> None:
        """Write the rows of `part` into the rows `index` of this state."""
        if len(part.buffers) != len(self.buffers):
            raise ValueError(f"state of another model: {len(part.buffers)} buffers, expected {len(self.buffers)}")
        for b, p in zip(self.buffers, part.buffers, strict=True):
            b.index_copy_(0, index, p)

    def reset_(self, index: Tensor) -> None:
        """Zero the rows `index`: those streams restart from silence."""
        for b in self.buffers:
            b.index_fill_(0, index, 0)


class AudioVAE(nn.Module):
    """The VoxCPM AudioVAE, v1 or v2 by `config.version`, for CPU and GPU, one stream or a batch."""

    def __init__(self, config: AudioVAEConfig):
        super().__init__()
        if not config.depthwise or config.use_noise_block:
            raise ValueError("AudioVAE supports only depthwise residual units without noise blocks (all releases)")
        self.config = config
        self.sample_rate = config.sample_rate
        self.out_sample_rate = config.out_sample_rate
        self.latent_dim = config.latent_dim
        self.encoder_hop = config.encoder_hop
        self.decoder_hop = config.decoder_hop
        self.encoder = Encoder(config)
        self.decoder = Decoder(config)

    @torch.no_grad()
    def encode(self, audio: Tensor) -> Tensor:
        """[B, 1, T] (or [B, T]) audio at `sample_rate` -> [B, latent_dim, ceil(T / encoder_hop)] latent means.

        The audio is right-padded with zeros to a whole number of frames, as the official `encode` does."""
        if audio.ndim == 2:
            audio = audio.unsqueeze(1)
        if audio.ndim != 3 or audio.shape[1] != 1 or audio.shape[-1] == 0:
            raise ValueError(f"encode expects mono audio [B, 1, T] with T > 0, got shape {tuple(audio.shape)}")
        pad = -audio.shape[-1] % self.encoder_hop
        return self.encoder(F.pad(audio, (0, pad)))

    def encode_state(self, batch: int = 1) -> StreamState:
        """Fresh encoder history (silence, as offline encoding's left padding) for `batch` streams, float32."""
        weight = self.encoder.block[0].weight
        return StreamState([torch.zeros(batch, m.in_channels, m.context, device=weight.device, dtype=weight.dtype)
                            for m in self.encoder.stateful])

    @torch.no_grad()
    def encode_stream(self, audio: Tensor, state: StreamState) -> Tensor:
        """Encode the next samples [B, 1, T] (T a multiple of `encoder_hop`) of B streams; updates state in place.
        Fully causal, so the concatenated chunks equal `encode` of the whole audio (to float rounding)."""
        if audio.ndim != 3 or audio.shape[1] != 1 or audio.shape[-1] % self.encoder_hop:
            raise ValueError(f"encode_stream expects [B, 1, T] with T a multiple of {self.encoder_hop}, "
                             f"got shape {tuple(audio.shape)}")
        return self.encoder(audio, state.buffers)

    @torch.no_grad()
    def decode(self, latents: Tensor) -> Tensor:
        """[B, latent_dim, frames] -> [B, 1, frames * decoder_hop] audio at `out_sample_rate`, in [-1, 1]."""
        self._check_latents(latents)
        with gemms_like_convs():
            return self.decoder(latents)

    def stream_state(self, batch: int, device: torch.device | str | None = None,
                     dtype: torch.dtype | None = None) -> StreamState:
        """Fresh decoder history (silence) for `batch` streams."""
        weight = self.decoder.model[0].weight
        device = weight.device if device is None else device
        dtype = weight.dtype if dtype is None else dtype
        return StreamState([torch.zeros(batch, c, n, device=device, dtype=dtype)
                            for c, n in self.decoder.state_shapes()])

    @torch.no_grad()
    def decode_stream(self, latents: Tensor, state: StreamState) -> Tensor:
        """Decode the next frames of B streams; updates state in place. Concatenated chunks == decode() of the
        whole sequence (v1 AND v2, to float rounding), for any chunking (1 frame, a patch of P frames, uneven)."""
        self._check_latents(latents)
        if len(state.buffers) != len(self.decoder.stateful) or state.batch != latents.shape[0]:
            raise ValueError(f"stream state holds {state.batch} streams of {len(state.buffers)} buffers; latents have "
                             f"{latents.shape[0]} streams and this model needs {len(self.decoder.stateful)} buffers")
        if state.buffers[0].dtype != latents.dtype:
            raise ValueError(f"stream state is {state.buffers[0].dtype} but latents are {latents.dtype}")
        with gemms_like_convs():
            return self.decoder(latents, state.buffers)

    def _check_latents(self, latents: Tensor) -> None:
        if latents.ndim != 3 or latents.shape[1] != self.latent_dim or latents.shape[-1] == 0:
            raise ValueError(f"expected latents [B, {self.latent_dim}, frames > 0], got shape {tuple(latents.shape)}")


def _weight_norm_role(key: str) -> tuple[str, str, str] | None:
    """(module prefix, this role's suffix, partner's suffix) if `key` is half of a weight-norm pair."""
    for g, v in (("weight_g", "weight_v"), ("parametrizations.weight.original0", "parametrizations.weight.original1")):
        for mine, other in ((g, v), (v, g)):
            if key == mine or key.endswith("." + mine):
                return key[: -len(mine)], mine, other
    return None


def fold_weight_norm(state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
    """Replace each weight-norm pair `X.weight_g`, `X.weight_v` by `X.weight = g * v / ||v||`.

    The norm runs over all dims except 0, as `torch.nn.utils.weight_norm(module)` (dim=0) applies it to Conv1d and
    ConvTranspose1d alike. The newer `X.parametrizations.weight.original0/1` spelling is folded the same way.
    Other entries pass through unchanged; the input is not modified."""
    out: dict[str, Tensor] = {}
    for key, value in state_dict.items():
        role = _weight_norm_role(key)
        if role is None:
            out[key] = value
            continue
        prefix, mine, other = role
        if prefix + other not in state_dict:
            raise ValueError(f"weight norm: {key} has no matching {prefix + other}")
        if mine.endswith(("_v", "original1")):
            continue  # folded when its g is reached
        g, v = value.float(), state_dict[prefix + other].float()
        norm = v.norm(dim=tuple(range(1, v.ndim)), keepdim=True)
        out[prefix + "weight"] = (v * (g / norm)).to(state_dict[prefix + other].dtype)
    return out
