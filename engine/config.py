"""Model configuration for the VoxCPM family, parsed from a release `config.json`.

Both code families are described by one `ModelConfig`: `architecture == "voxcpm"` (VoxCPM-0.5B, VoxCPM1.5) or
`"voxcpm2"`. Version differences are fields and small switches, never separate classes. Every validation failure
raises `ConfigError` naming the file and the field, so a bad checkpoint is a one-line message, not a traceback.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

ARCHITECTURES = ("voxcpm", "voxcpm2")
DTYPES = ("float32", "bfloat16", "float16")


class ConfigError(ValueError):
    """A model config is missing a field or holds a value the model cannot use."""


@dataclass(frozen=True)
class RopeScaling:
    type: str
    short_factor: tuple[float, ...]
    long_factor: tuple[float, ...]
    original_max_position_embeddings: int


@dataclass(frozen=True)
class StackConfig:
    """One MiniCPM transformer stack (base LM, residual LM, LocEnc or LocDiT)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling
    max_position_embeddings: int
    vocab_size: int
    kv_channels: int | None = None
    no_rope: bool = False
    use_mup: bool = False
    scale_emb: float = 1.0
    dim_model_base: int = 256
    scale_depth: float = 1.0
    bos_token_id: int = 1
    eos_token_id: int = 2

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def rope_factors(self) -> tuple[float, ...]:
        """The LongRoPE factors the official code uses for this stack."""
        long = self.max_position_embeddings > self.rope_scaling.original_max_position_embeddings
        return self.rope_scaling.long_factor if long else self.rope_scaling.short_factor

    def derive(self, *, hidden: int, ffn: int, heads: int, layers: int, kv_channels: int | None,
               no_rope: bool = False) -> StackConfig:
        """A sub-stack config: copies this one and overrides only the sizes (as the official code does)."""
        return replace(self, hidden_size=hidden, intermediate_size=ffn, num_attention_heads=heads,
                       num_hidden_layers=layers, kv_channels=kv_channels, no_rope=no_rope)


@dataclass(frozen=True)
class LocalStackConfig:
    """`encoder_config` / `dit_config`: the sizes of LocEnc and LocDiT."""

    hidden_dim: int = 1024
    ffn_dim: int = 4096
    num_heads: int = 16
    num_layers: int = 4
    kv_channels: int | None = None


@dataclass(frozen=True)
class CfmConfig:
    sigma_min: float = 1e-6
    solver: str = "euler"
    t_scheduler: str = "log-norm"
    inference_cfg_rate: float = 1.0


@dataclass(frozen=True)
class AudioVAEConfig:
    """AudioVAE v1 (symmetric) or v2 (16 kHz in, 48 kHz out, sample-rate conditioned decoder)."""

    version: int = 1
    encoder_dim: int = 128
    encoder_rates: tuple[int, ...] = (2, 5, 8, 8)
    latent_dim: int = 64
    decoder_dim: int = 1536
    decoder_rates: tuple[int, ...] = (8, 8, 5, 2)
    depthwise: bool = True
    sample_rate: int = 16000
    out_sample_rate: int = 16000
    use_noise_block: bool = False
    sr_bin_boundaries: tuple[int, ...] | None = None
    cond_type: str = "scale_bias"
    cond_dim: int = 128
    cond_out_layer: bool = False

    @property
    def encoder_hop(self) -> int:
        """Input samples per latent frame."""
        return math.prod(self.encoder_rates)

    @property
    def decoder_hop(self) -> int:
        """Output samples per latent frame."""
        return math.prod(self.decoder_rates)


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    lm: StackConfig
    encoder: LocalStackConfig
    dit: LocalStackConfig
    cfm: CfmConfig
    audio_vae: AudioVAEConfig
    patch_size: int
    feat_dim: int = 64
    residual_lm_num_layers: int = 6
    residual_lm_no_rope: bool = False
    fsq_latent_dim: int = 256
    fsq_scale: int = 9
    dit_mean_mode: bool = False
    max_length: int = 4096
    dtype: str = "bfloat16"
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def is_v2(self) -> bool:
        return self.architecture == "voxcpm2"

    @property
    def residual_lm(self) -> StackConfig:
        return self.lm.derive(hidden=self.lm.hidden_size, ffn=self.lm.intermediate_size,
                              heads=self.lm.num_attention_heads, layers=self.residual_lm_num_layers,
                              kv_channels=self.lm.kv_channels, no_rope=self.residual_lm_no_rope)

    @property
    def encoder_lm(self) -> StackConfig:
        e = self.encoder
        return self.lm.derive(hidden=e.hidden_dim, ffn=e.ffn_dim, heads=e.num_heads, layers=e.num_layers,
                              kv_channels=e.kv_channels)

    @property
    def dit_lm(self) -> StackConfig:
        d = self.dit
        return self.lm.derive(hidden=d.hidden_dim, ffn=d.ffn_dim, heads=d.num_heads, layers=d.num_layers,
                              kv_channels=d.kv_channels)

    @property
    def sample_rate(self) -> int:
        """Sample rate of the audio the model produces."""
        return self.audio_vae.out_sample_rate

    @property
    def samples_per_patch(self) -> int:
        return self.patch_size * self.audio_vae.decoder_hop

    @property
    def patch_ms(self) -> float:
        return 1000.0 * self.samples_per_patch / self.sample_rate

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path}: file not found") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        return cls.from_dict(data, source=str(path))

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "config") -> ModelConfig:
        """Parse and validate a release config dict; unknown keys are ignored like the official code does."""
        return _Parser(source).model(data)

    def to_dict(self) -> dict[str, Any]:
        """The release `config.json` form of this config (round-trips through `from_dict`)."""
        lm = asdict(self.lm)
        lm["rope_scaling"] = {**lm["rope_scaling"], "short_factor": list(self.lm.rope_scaling.short_factor),
                              "long_factor": list(self.lm.rope_scaling.long_factor)}
        lm.pop("no_rope")
        if lm["kv_channels"] is None:
            lm.pop("kv_channels")  # the official pydantic schema rejects an explicit null
        vae = asdict(self.audio_vae)
        vae.pop("version")
        vae["encoder_rates"], vae["decoder_rates"] = list(vae["encoder_rates"]), list(vae["decoder_rates"])
        if self.is_v2:
            vae["sr_bin_boundaries"] = list(vae["sr_bin_boundaries"] or ())
        else:
            for key in ("out_sample_rate", "sr_bin_boundaries", "cond_type", "cond_dim", "cond_out_layer"):
                vae.pop(key)

        def local(c: LocalStackConfig) -> dict[str, Any]:
            d = asdict(c)
            if d["kv_channels"] is None:
                d.pop("kv_channels")
            return d

        dit = local(self.dit) | {"dit_mean_mode": self.dit_mean_mode, "cfm_config": asdict(self.cfm)}
        out: dict[str, Any] = {
            "architecture": self.architecture, "lm_config": lm, "patch_size": self.patch_size,
            "feat_dim": self.feat_dim, "residual_lm_num_layers": self.residual_lm_num_layers,
            "scalar_quantization_latent_dim": self.fsq_latent_dim, "scalar_quantization_scale": self.fsq_scale,
            "encoder_config": local(self.encoder), "dit_config": dit, "audio_vae_config": vae,
            "max_length": self.max_length, "dtype": self.dtype,
        }
        if self.is_v2:
            out["residual_lm_no_rope"] = self.residual_lm_no_rope
        else:
            out["dit_mean_mode"] = self.dit_mean_mode
        return out


class _Parser:
    """Reads config dicts field by field so every error names `source: path.to.field`."""

    def __init__(self, source: str):
        self.source = source

    def fail(self, key: str, msg: str) -> ConfigError:
        return ConfigError(f"{self.source}: {key}: {msg}")

    def section(self, data: dict[str, Any], key: str, required: bool = True) -> dict[str, Any]:
        value = data.get(key.rsplit(".", 1)[-1])
        if value is None:
            if required:
                raise self.fail(key, "missing")
            return {}
        if not isinstance(value, dict):
            raise self.fail(key, f"must be an object (got {type(value).__name__})")
        return value

    def get(self, data: dict[str, Any], prefix: str, name: str, kind: type, default: Any = ...,
            positive: bool = False) -> Any:
        key = f"{prefix}.{name}" if prefix else name
        if name not in data or data[name] is None:
            if default is ...:
                raise self.fail(key, "missing")
            return default
        value = data[name]
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if kind is int and isinstance(value, float) and value.is_integer():
            value = int(value)
        if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
            raise self.fail(key, f"must be {kind.__name__} (got {value!r})")
        if positive and not (value > 0 and math.isfinite(value)):
            raise self.fail(key, f"must be positive (got {value!r})")
        return value

    def ints(self, data: dict[str, Any], prefix: str, name: str, default: Any = ...) -> tuple[int, ...]:
        key = f"{prefix}.{name}"
        value = data.get(name, default)
        if value is ...:
            raise self.fail(key, "missing")
        if not isinstance(value, (list, tuple)) or not value or not all(
                isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value):
            raise self.fail(key, f"must be a non-empty list of positive integers (got {value!r})")
        return tuple(value)

    def model(self, data: dict[str, Any]) -> ModelConfig:
        if not isinstance(data, dict):
            raise ConfigError(f"{self.source}: must be a JSON object")
        arch = data.get("architecture", "voxcpm")
        if arch not in ARCHITECTURES:
            raise self.fail("architecture", f"unknown architecture {arch!r} (known: {', '.join(ARCHITECTURES)})")
        v2 = arch == "voxcpm2"
        lm = self.lm(self.section(data, "lm_config"))
        g = self.get
        patch_size = g(data, "", "patch_size", int, 4 if v2 else 2, positive=True)
        feat_dim = g(data, "", "feat_dim", int, 64, positive=True)
        encoder = self.local(self.section(data, "encoder_config"), "encoder_config")
        dit_data = self.section(data, "dit_config")
        dit = self.local(dit_data, "dit_config")
        cfm_data = self.section(dit_data, "dit_config.cfm_config")
        cfm = CfmConfig(
            sigma_min=g(cfm_data, "dit_config.cfm_config", "sigma_min", float, 1e-6),
            solver=g(cfm_data, "dit_config.cfm_config", "solver", str, "euler"),
            t_scheduler=g(cfm_data, "dit_config.cfm_config", "t_scheduler", str, "log-norm"),
            inference_cfg_rate=g(cfm_data, "dit_config.cfm_config", "inference_cfg_rate", float, 1.0),
        )
        if cfm.solver != "euler":
            raise self.fail("dit_config.cfm_config.solver", f"only 'euler' is supported (got {cfm.solver!r})")
        mean_mode = g(dit_data, "dit_config", "dit_mean_mode", bool, False) if v2 else \
            g(data, "", "dit_mean_mode", bool, False)
        vae = self.vae(self.section(data, "audio_vae_config", required=False), v2)
        if vae.latent_dim != feat_dim:
            raise self.fail("audio_vae_config.latent_dim", f"must equal feat_dim {feat_dim} (got {vae.latent_dim})")
        dtype = g(data, "", "dtype", str, "bfloat16")
        if dtype not in DTYPES:
            raise self.fail("dtype", f"must be one of {', '.join(DTYPES)} (got {dtype!r})")
        cfg = ModelConfig(
            architecture=arch, lm=lm, encoder=encoder, dit=dit, cfm=cfm, audio_vae=vae, patch_size=patch_size,
            feat_dim=feat_dim,
            residual_lm_num_layers=g(data, "", "residual_lm_num_layers", int, 8 if v2 else 6, positive=True),
            residual_lm_no_rope=g(data, "", "residual_lm_no_rope", bool, False) if v2 else False,
            fsq_latent_dim=g(data, "", "scalar_quantization_latent_dim", int, 512 if v2 else 256, positive=True),
            fsq_scale=g(data, "", "scalar_quantization_scale", int, 9, positive=True),
            dit_mean_mode=mean_mode,
            max_length=g(data, "", "max_length", int, 8192 if v2 else 4096, positive=True),
            dtype=dtype, raw=data,
        )
        for name, stack in (("encoder_config", cfg.encoder_lm), ("dit_config", cfg.dit_lm)):
            self.check_heads(stack, name)
            if stack.head_dim != lm.head_dim:
                raise self.fail(f"{name}.kv_channels", f"head dim {stack.head_dim} differs from the LM's "
                                f"{lm.head_dim}: all stacks share one head dim")
        return cfg

    def lm(self, d: dict[str, Any]) -> StackConfig:
        p, g = "lm_config", self.get
        rope = self.section(d, "lm_config.rope_scaling")
        rp = "lm_config.rope_scaling"
        rope_cfg = RopeScaling(
            type=g(rope, rp, "type", str, "longrope"),
            short_factor=self.floats(rope, rp, "short_factor"),
            long_factor=self.floats(rope, rp, "long_factor"),
            original_max_position_embeddings=g(rope, rp, "original_max_position_embeddings", int, positive=True),
        )
        stack = StackConfig(
            hidden_size=g(d, p, "hidden_size", int, positive=True),
            intermediate_size=g(d, p, "intermediate_size", int, positive=True),
            num_hidden_layers=g(d, p, "num_hidden_layers", int, positive=True),
            num_attention_heads=g(d, p, "num_attention_heads", int, positive=True),
            num_key_value_heads=g(d, p, "num_key_value_heads", int, positive=True),
            rms_norm_eps=g(d, p, "rms_norm_eps", float, positive=True),
            rope_theta=g(d, p, "rope_theta", float, positive=True),
            rope_scaling=rope_cfg,
            max_position_embeddings=g(d, p, "max_position_embeddings", int, positive=True),
            vocab_size=g(d, p, "vocab_size", int, positive=True),
            kv_channels=g(d, p, "kv_channels", int, None, positive=True),
            use_mup=g(d, p, "use_mup", bool, True),  # the official schema defaults to True
            scale_emb=g(d, p, "scale_emb", float, 1.0),
            dim_model_base=g(d, p, "dim_model_base", int, 256, positive=True),
            scale_depth=g(d, p, "scale_depth", float, 1.0),
            bos_token_id=g(d, p, "bos_token_id", int, 1),
            eos_token_id=g(d, p, "eos_token_id", int, 2),
        )
        self.check_heads(stack, p)
        if stack.head_dim % 2:
            raise self.fail(f"{p}.kv_channels", f"head dim must be even for RoPE (got {stack.head_dim})")
        for name in ("short_factor", "long_factor"):
            n = len(getattr(rope_cfg, name))
            if n != stack.head_dim // 2:
                raise self.fail(f"{rp}.{name}", f"needs head_dim/2 = {stack.head_dim // 2} values (got {n})")
        return stack

    def check_heads(self, stack: StackConfig, prefix: str) -> None:
        if stack.num_attention_heads % stack.num_key_value_heads:
            raise self.fail(f"{prefix}.num_attention_heads", f"{stack.num_attention_heads} is not a multiple of "
                            f"num_key_value_heads {stack.num_key_value_heads}")
        if stack.kv_channels is None and stack.hidden_size % stack.num_attention_heads:
            raise self.fail(f"{prefix}.hidden_size", f"{stack.hidden_size} is not divisible by "
                            f"{stack.num_attention_heads} heads (set kv_channels)")

    def floats(self, data: dict[str, Any], prefix: str, name: str) -> tuple[float, ...]:
        value = data.get(name)
        if not isinstance(value, list) or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0
                for v in value):
            raise self.fail(f"{prefix}.{name}", "must be a list of positive numbers")
        return tuple(float(v) for v in value)

    def local(self, d: dict[str, Any], p: str) -> LocalStackConfig:
        g = self.get
        return LocalStackConfig(
            hidden_dim=g(d, p, "hidden_dim", int, 1024, positive=True),
            ffn_dim=g(d, p, "ffn_dim", int, 4096, positive=True),
            num_heads=g(d, p, "num_heads", int, 16, positive=True),
            num_layers=g(d, p, "num_layers", int, 4, positive=True),
            kv_channels=g(d, p, "kv_channels", int, None, positive=True),
        )

    def vae(self, d: dict[str, Any], v2: bool) -> AudioVAEConfig:
        p, g = "audio_vae_config", self.get
        sample_rate = g(d, p, "sample_rate", int, 16000, positive=True)
        cfg = AudioVAEConfig(
            version=2 if v2 else 1,
            encoder_dim=g(d, p, "encoder_dim", int, 128, positive=True),
            encoder_rates=self.ints(d, p, "encoder_rates", [2, 5, 8, 8]),
            latent_dim=g(d, p, "latent_dim", int, 64, positive=True),
            decoder_dim=g(d, p, "decoder_dim", int, 2048 if v2 else 1536, positive=True),
            decoder_rates=self.ints(d, p, "decoder_rates", [8, 6, 5, 2, 2, 2] if v2 else [8, 8, 5, 2]),
            depthwise=g(d, p, "depthwise", bool, True),
            sample_rate=sample_rate,
            out_sample_rate=g(d, p, "out_sample_rate", int, 48000, positive=True) if v2 else sample_rate,
            use_noise_block=g(d, p, "use_noise_block", bool, False),
            sr_bin_boundaries=self.ints(d, p, "sr_bin_boundaries", [20000, 30000, 40000]) if v2 else None,
            cond_type=g(d, p, "cond_type", str, "scale_bias"),
            cond_dim=g(d, p, "cond_dim", int, 128, positive=True),
            cond_out_layer=g(d, p, "cond_out_layer", bool, False),
        )
        if not cfg.depthwise:
            raise self.fail(f"{p}.depthwise", "only depthwise residual units are supported (all releases use them)")
        if cfg.use_noise_block:
            raise self.fail(f"{p}.use_noise_block", "noise blocks are not supported (no release uses them)")
        if v2 and cfg.cond_type != "scale_bias":
            raise self.fail(f"{p}.cond_type", f"only 'scale_bias' is supported (got {cfg.cond_type!r})")
        # One latent frame must cover the same time at the encoder's and the decoder's rate.
        if cfg.encoder_hop * cfg.out_sample_rate != cfg.decoder_hop * cfg.sample_rate:
            raise self.fail(f"{p}.decoder_rates", f"decoder hop {cfg.decoder_hop} at {cfg.out_sample_rate} Hz does "
                            f"not match encoder hop {cfg.encoder_hop} at {cfg.sample_rate} Hz")
        return cfg
