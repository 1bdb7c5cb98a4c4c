"""One definition per option: `EngineConfig` and `GatewayConfig` fields are the CLI's flags (every field a flag, every
flag a field), the README's flag table is generated from them, a flag's value reaches its field, the CLI's defaults
are the configs' and the running server's, and bad values are one-line typed errors."""

from __future__ import annotations

import argparse
import re
from dataclasses import fields
from pathlib import Path

import pytest

from engine import InvalidParameter
from engine.engine_config import EngineConfig
from engine.options import options_of
from engine.worker import WorkerConfig
from gateway.cli import SERVE_ONLY_ENGINE_OPTIONS, _engine_kwargs, _parser, _server_config, main
from gateway.flags import flag_table, given
from gateway.gateway_config import GatewayConfig
from gateway.protocol import Limits
from gateway.server import WEB_CLIENT_DIR, ServerConfig

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = (EngineConfig, GatewayConfig)
NOT_CONFIG = {"--help", "--model", "--config"}  # Engine's positional model; the config file itself
SAY_OWN = {"--help", "--output", "--prompt-wav", "--prompt-text", "--reference-wav", "--instruction", "--server",
           "--api-key", "--seed", "--cfg", "--normalize", "--model"}  # one utterance's arguments, not configuration


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    return {o for a in parser._actions for o in a.option_strings if o.startswith("--")}


def _command(name: str) -> argparse.ArgumentParser:
    sub = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def _config_flags(cls: type, skip: tuple[str, ...] = ()) -> set[str]:
    return {opt.flag for name, opt in options_of(cls).items() if name not in skip}


def test_every_config_field_is_an_option_with_help_and_a_unique_flag():
    all_flags = []
    for cls in CONFIGS:
        options = options_of(cls)
        assert set(options) == {f.name for f in fields(cls)}, f"{cls.__name__}: a field without option metadata"
        for name, opt in options.items():
            assert opt.flag.startswith("--") and opt.help.strip(), f"{cls.__name__}.{name}"
        all_flags += [opt.flag for opt in options.values()]
    assert len(all_flags) == len(set(all_flags)), "two fields share a flag"


def test_every_serve_flag_is_a_field_and_every_field_a_serve_flag():
    flags = _flags(_command("serve"))
    assert flags - NOT_CONFIG == _config_flags(EngineConfig) | _config_flags(GatewayConfig)


def test_say_takes_the_engine_flags_and_the_log_flags():
    flags = _flags(_command("say"))
    engine = _config_flags(EngineConfig, SERVE_ONLY_ENGINE_OPTIONS)
    assert flags - SAY_OWN == engine | {"--log-level", "--log-json"}


def test_readme_flag_table_is_generated_from_the_configs():
    readme = (ROOT / "README.md").read_text()
    table = re.search(r"<!-- flags:begin -->\n(.*?)<!-- flags:end -->", readme, re.S)
    assert table, "README.md has no <!-- flags:begin/end --> block"
    assert table.group(1).strip() == flag_table(*CONFIGS).strip(), "regenerate it: python -m gateway.flags"


def test_no_flag_given_means_every_default_and_the_servers_own():
    args = _parser().parse_args(["serve"])
    assert _engine_kwargs(args) == {} and EngineConfig(**_engine_kwargs(args)) == EngineConfig()
    gateway = GatewayConfig(**given(GatewayConfig, args))
    assert gateway == GatewayConfig()
    # what `voxgate serve` runs with is what `ServerConfig()` and `Limits()` hold by default
    assert _server_config(gateway, None) == ServerConfig(web_client_dir=WEB_CLIENT_DIR)
    assert ServerConfig().session.limits == Limits()


@pytest.mark.parametrize(("argv", "field", "value"), [
    (["--sit-out-ms", "500"], "sit_out_ms", 500.0),
    (["--timesteps", "4"], "inference_timesteps", 4),
    (["--max-waiting", "0"], "max_waiting", 0),
    (["--dtype", "bfloat16"], "dtype", "bfloat16"),
    (["--gpu-memory-utilization", "0.5"], "gpu_memory_utilization", 0.5),
    (["--devices", "cpu,cpu"], "devices", ("cpu", "cpu")),
    (["--split-decodes-above", "0"], "split_decodes_above", None),
    (["--no-merge-lora"], "merge_lora", False),
    (["--max-queued-per-key", "3"], "max_queued_per_tenant", 3),
])
def test_an_engine_flag_reaches_its_field(argv, field, value):
    config = EngineConfig(**_engine_kwargs(_parser().parse_args(["serve", *argv])))
    assert getattr(config, field) == value
    assert config == EngineConfig(**{field: value})


@pytest.mark.parametrize("cls", CONFIGS)
def test_each_default_given_as_a_flag_is_the_default(cls):
    """Every flag's parsing gives its field's type: the default, written on the command line, comes back as itself."""
    command = "serve"
    for f in fields(cls):
        opt = options_of(cls)[f.name]
        if f.default is None or isinstance(f.default, bool):
            continue
        args = _parser().parse_args([command, opt.flag, str(f.default)])
        assert given(cls, args) == {f.name: f.default}, opt.flag


def test_gateway_flags_reach_the_running_servers_config():
    args = _parser().parse_args(["serve", "--idle-timeout", "5", "--max-sessions", "7", "--strict-voices",
                                 "--session-lease-ttl", "3", "--shutdown-timeout", "0", "--web-client", "/srv/x"])
    server = _server_config(GatewayConfig(**given(GatewayConfig, args)), "secret")
    assert (server.limits.idle_timeout_s, server.max_sessions, server.strict_voices, server.lease_ttl_s) == (
        5.0, 7, True, 3.0)
    assert (server.shutdown_timeout_s, server.web_client_dir, server.metrics_key) == (0.0, Path("/srv/x"), "secret")


def test_a_worker_config_carries_every_engine_field():
    config = EngineConfig(max_num_seqs=3, sit_out_ms=10.0, worker_threads=2, split_decodes_above=None,
                          vae_dtype="bfloat16", max_loras=2)
    worker = WorkerConfig.for_group(config, "model-dir", ["cpu", "cpu"])
    assert all(getattr(worker, name) == value for name, value in config.as_kwargs().items())
    assert (worker.model, worker.device, worker.tp_devices) == ("model-dir", "cpu", ("cpu", "cpu"))
    assert WorkerConfig.for_group(config, "m", ["cpu"]).tp_devices == ()


@pytest.mark.parametrize(("kwargs", "words"), [
    (dict(max_num_seqs=0), r"max_num_seqs must be an integer in \[1, inf\]"),
    (dict(inference_timesteps=101), r"inference_timesteps must be an integer in \[1, 100\]"),
    (dict(inference_timesteps=4, max_timesteps=3), r"max_timesteps must be an integer in \[4, 100\]"),
    (dict(gpu_memory_utilization=0.0), r"gpu_memory_utilization must be in \(0, 1\]"),
    (dict(sit_out_ms=float("nan")), "sit_out_ms must be a finite number"),
    (dict(vae_dtype="float16"), "vae_dtype: 'float16' is not one of float32, bfloat16"),
    (dict(split_decodes_above=0), "split_decodes_above must be an integer"),
    (dict(fp8_dit=True, max_loras=1), "do not combine with LoRA"),
    (dict(fp8_prefill=True, tensor_parallel_size=2), "do not combine with tensor parallelism"),
    (dict(max_queued_per_tenant=0), "max_queued_per_tenant must be an integer"),
    (dict(worker_threads=True), "worker_threads must be an integer"),
])
def test_bad_engine_values_are_refused_by_the_config(kwargs, words):
    with pytest.raises(InvalidParameter, match=words):
        EngineConfig(**kwargs)


def test_keywords_and_config_meet_the_same_checks(tiny_v2_dir):
    """`Engine(model, **kwargs)` is `EngineConfig(**kwargs)`: its errors come before any model is read or worker
    started (no event loop is needed to see them)."""
    from engine import Engine

    with pytest.raises(InvalidParameter, match="max_num_seqs"):
        Engine(str(tiny_v2_dir), max_num_seqs=0)
    with pytest.raises(InvalidParameter, match="max_num_seqs"):
        Engine(str(tiny_v2_dir), config=EngineConfig(), max_num_seqs=0)
    with pytest.raises(TypeError, match="no_such_option"):
        Engine(str(tiny_v2_dir), no_such_option=1)


@pytest.mark.parametrize(("argv", "words"), [
    (["serve", "--max-sessions", "0"], "max_sessions must be an integer in [1, inf]"),
    (["serve", "--port", "70000"], "port must be an integer in [0, 65535]"),
    (["serve", "--idle-timeout", "-1"], "idle_timeout_s must be a finite number"),
    (["serve", "--log-level", "loud"], "log_level: unknown level 'loud'"),
    (["serve", "--api-keys-from-store"], "--api-keys-from-store needs --store"),
    (["say", "Hi.", "-o", "/dev/null", "--timesteps", "0"], "cannot start the engine: inference_timesteps must be"),
    (["say", "Hi.", "-o", "/dev/null", "--devices", "0,x"], "--devices '0,x': expected indices like 0,1 (or cpu)"),
])
def test_bad_flags_are_one_line_errors(capsys, argv, words):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_the_protocols_request_defaults_are_the_engines():
    """The sans-I/O protocol module imports nothing of the engine (the gateway uses the engine's public API only), so
    it writes a turn's default settings itself: they must be the engine's request defaults."""
    from engine.request import SamplingParams
    from gateway.protocol import GenerationSettings

    ours, engines = GenerationSettings(), SamplingParams()
    assert (ours.cfg_value, ours.temperature) == (engines.cfg_value, engines.temperature)
