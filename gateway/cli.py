"""The `voxgate` command: `voxgate serve` (the gateway) and `voxgate say` (one utterance to a WAV file)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.engine_config import EngineConfig
from engine.sampling import SamplingParams
from gateway.config_file import ConfigFileError, with_config_file
from gateway.flags import FlagError, add_flags, given
from gateway.gateway_config import GatewayConfig
from gateway.log_setup import setup_logging
from gateway.store.local import DEFAULT_DATA_DIR
from gateway.text import normalize as spoken

if TYPE_CHECKING:
    import numpy as np

    from gateway.server import ServerConfig
    from gateway.store import Store

log = logging.getLogger("voxgate")

LOG_OPTIONS = ("log_level", "log_json")  # GatewayConfig options that `say` takes too
SERVE_ONLY_ENGINE_OPTIONS = ("max_queued_per_tenant",)  # `say` speaks one request
DEMO_WARNING = ("THE MODEL IS THE TINY BUILT-IN DEMO (random weights): the audio is NOT speech. "
                "Pass --model DIR_OR_HF_ID for a real VoxCPM checkpoint.")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = _parser()
    args = parser.parse_args(argv)
    if getattr(args, "config", None):
        try:
            args = parser.parse_args(with_config_file(parser, argv, args.config))
        except ConfigFileError as e:
            print(f"voxgate: error: --config {e}", file=sys.stderr)
            return 2
    try:
        gateway = GatewayConfig(**given(GatewayConfig, args))
    except (FlagError, ValueError) as e:
        print(f"voxgate: error: {e}", file=sys.stderr)
        return 2
    setup_logging(gateway.log_level, gateway.log_json)
    try:
        return asyncio.run(args.run(args, gateway))
    except KeyboardInterrupt:
        return 130
    except CliError as e:
        print(f"voxgate: error: {e}", file=sys.stderr)
        return 2


def _version() -> str:
    """The installed distribution's version ("unknown" when run from a checkout that was never installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("voxgate")
    except PackageNotFoundError:
        return "unknown (not installed)"


class CliError(Exception):
    """A user-facing failure: printed as one line, no traceback."""


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="voxgate", description="Real-time streaming speech from VoxCPM models.")
    ap.add_argument("--version", action="version", version=f"%(prog)s {_version()}",
                    help="print the installed voxgate version and exit")
    sub = ap.add_subparsers(required=True, metavar="COMMAND")

    def common(p: argparse.ArgumentParser) -> None:
        add_flags(p, GatewayConfig, only=LOG_OPTIONS)

    def engine_args(p: argparse.ArgumentParser, *, skip: tuple[str, ...] = ()) -> None:
        p.add_argument("--model", help="model directory or Hugging Face id (default: VoxCPM2 on a GPU, else the "
                                       "tiny demo model)")
        add_flags(p, EngineConfig, skip=skip)

    serve = sub.add_parser("serve", help="run the gateway")
    engine_args(serve)
    add_flags(serve, GatewayConfig, skip=LOG_OPTIONS)
    serve.add_argument("--config", help="TOML file of serve settings, keyed by these flags' names (max-sessions = "
                                        "500; deploy/voxgate.toml lists them all); flags given here override it")
    common(serve)
    serve.set_defaults(run=_serve)

    say = sub.add_parser("say", help="speak a text into a WAV file")
    say.add_argument("text", nargs="?", help="the text (default: read stdin)")
    say.add_argument("-o", "--output", required=True, help="output WAV file")
    engine_args(say, skip=SERVE_ONLY_ENGINE_OPTIONS)
    say.add_argument("--prompt-wav", help="voice prompt audio (continuation: also give --prompt-text)")
    say.add_argument("--prompt-text", help="transcript of --prompt-wav")
    say.add_argument("--reference-wav", help="reference voice audio (VoxCPM2)")
    say.add_argument("--instruction", help="style instruction, VoxCPM2 voice design (\"warm female voice, slow\"): "
                     "spoken as (instruction)text, as `voxcpm design --control`; not with --prompt-wav")
    say.add_argument("--server", help="speak through a running gateway, e.g. ws://127.0.0.1:8080")
    say.add_argument("--api-key", help="API key for --server")
    say.add_argument("--seed", type=int, default=None,
                     help="random seed: the same seed, text and voice give the same audio (default: a new one)")
    say.add_argument("--cfg", type=float, default=SamplingParams.cfg_value,
                     help="classifier-free guidance: higher follows the text and voice more closely (default "
                          "%(default)s)")
    say.add_argument("--normalize", choices=spoken.MODES, default="auto",
                     help="numbers, money, dates and units spoken as words (docs/PROTOCOL.md, generation.normalize)")
    common(say)
    say.set_defaults(run=_say)
    return ap


def _engine_kwargs(args: argparse.Namespace) -> dict:
    """The `EngineConfig` fields whose flags were given (the rest keep the engine's defaults)."""
    try:
        return given(EngineConfig, args)
    except FlagError as e:
        raise CliError(str(e)) from None


async def _start_engine(args: argparse.Namespace):
    from engine import Engine, EngineError

    try:
        engine = Engine.from_pretrained(args.model, config=EngineConfig(**_engine_kwargs(args)))
        await engine.wait_for_ready()
    except (EngineError, OSError, ValueError) as e:
        raise CliError(f"cannot start the engine: {e}") from None
    info = engine.model_info()
    if info.is_demo:
        log.warning(DEMO_WARNING)
    return engine


def _check_switches() -> None:
    """Every VOXGATE_* switch parsed now: one that holds a value it does not take stops the start with its name,
    rather than failing the first request that reads it (the encode site is chosen per Opus turn)."""
    from engine.settings import EngineSettings, SettingError
    from gateway.settings import GatewaySettings

    try:
        EngineSettings.from_env()
        GatewaySettings.from_env()
    except SettingError as e:
        raise CliError(str(e)) from None


def _server_config(gateway: GatewayConfig, metrics_key: str | None) -> ServerConfig:
    """The running server's config from the serve options (`metrics_key`: read from --metrics-key-file)."""
    from gateway.protocol import Limits
    from gateway.server import WEB_CLIENT_DIR, ServerConfig
    from gateway.session import SessionConfig

    return ServerConfig(session=SessionConfig(limits=Limits(idle_timeout_s=gateway.idle_timeout_s)),
                        max_sessions=gateway.max_sessions, max_sessions_per_key=gateway.max_sessions_per_key,
                        shutdown_timeout_s=gateway.shutdown_timeout_s, metrics_key=metrics_key,
                        web_client_dir=Path(gateway.web_client_dir) if gateway.web_client_dir else WEB_CLIENT_DIR,
                        strict_voices=gateway.strict_voices, lease_ttl_s=gateway.lease_ttl_s)


async def _serve(args: argparse.Namespace, gateway: GatewayConfig) -> int:
    from gateway.auth import Auth
    from gateway.encode_site import start_encoders
    from gateway.fronts import front_count
    from gateway.gc_policy import settle_gc
    from gateway.http.readiness import drain
    from gateway.server import create_app, start_server
    from gateway.store import open_store

    _check_switches()
    try:
        auth = Auth.from_options(gateway.api_keys_file, gateway.api_keys_from_store)
    except (OSError, ValueError) as e:
        raise CliError(f"--api-keys-file: {e}") from None
    try:
        store = open_store(gateway.store_url,
                           None if gateway.store_url else Path(gateway.data_dir or DEFAULT_DATA_DIR))
    except (OSError, ValueError) as e:
        raise CliError(f"--data-dir / --store: {e}") from None
    print(f"voxgate: stored voices and adapters: {store.description}", file=sys.stderr)
    if not auth.enabled:
        log.warning("no --api-keys-file: every client may connect (fine on localhost or a trusted network)")
    metrics_key = _first_line(gateway.metrics_key_file, "--metrics-key-file") if gateway.metrics_key_file else None
    config = _server_config(gateway, metrics_key)
    fronts = front_count(gateway.fronts)
    engine = await _start_engine(args)
    if fronts > 1:
        return await _serve_fronts(engine, store, gateway, config, fronts)
    try:
        app = create_app(engine, config, auth=auth, compat=True, store=store,
                         restore_progress=lambda line: print(f"voxgate: {line}", file=sys.stderr))
        runner, port = await start_server(app, gateway.host, gateway.port,
                                          shutdown_timeout_s=gateway.shutdown_timeout_s + 5)
    except OSError as e:
        await engine.stop()
        raise CliError(f"cannot listen on {gateway.host}:{gateway.port}: {e}") from None
    start_encoders()
    settle_gc()  # the collector as every serving gateway process runs it (gateway.gc_policy says why)
    info = engine.model_info()
    print(f"voxgate: serving {info.name} ({info.sample_rate} Hz) on http://{gateway.host}:{port} "
          f"(WebSocket /v1/stream)", file=sys.stderr)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    print(f"voxgate: draining (/readyz 503, new sessions refused, turns in progress get up to "
          f"{gateway.shutdown_timeout_s:g} s)", file=sys.stderr)
    await drain(app)  # still listening, so balancers see the 503s and retry refused handshakes elsewhere
    await runner.cleanup()  # then stop listening and close what is left
    await engine.stop()
    return 0


async def _serve_fronts(engine: Any, store: Store, gateway: GatewayConfig, config: ServerConfig, fronts: int) -> int:
    """`voxgate serve --fronts N` (N > 1): this process runs the engine, N gateway processes serve the port."""
    from gateway.fronts import FrontArgs, FrontsError, serve_fronts

    info = engine.model_info()
    args = FrontArgs(config=config, api_keys_file=gateway.api_keys_file,
                     api_keys_from_store=gateway.api_keys_from_store, log_level=gateway.log_level,
                     log_json=gateway.log_json)

    def announce(port: int) -> None:
        print(f"voxgate: serving {info.name} ({info.sample_rate} Hz) on http://{gateway.host}:{port} "
              f"(WebSocket /v1/stream) with {fronts} gateway processes (fronts)", file=sys.stderr)

    try:
        return await serve_fronts(engine, store, fronts=fronts, host=gateway.host, port=gateway.port, front_args=args,
                                  announce=announce, progress=lambda line: print(f"voxgate: {line}", file=sys.stderr))
    except (FrontsError, OSError) as e:
        raise CliError(f"cannot serve on {gateway.host}:{gateway.port}: {e}") from None
    finally:
        await engine.stop()
        await store.close()


def _first_line(path: str, flag: str) -> str:
    """The first non-blank line of a file (a secret kept off the command line); CliError if there is none."""
    try:
        line = next((ln.strip() for ln in Path(path).read_text().splitlines() if ln.strip()), "")
    except OSError as e:
        raise CliError(f"{flag}: {e}") from None
    if not line:
        raise CliError(f"{flag}: {path} has no key")
    return line


def _read_text(args: argparse.Namespace) -> str:
    text = args.text if args.text is not None else sys.stdin.read()
    if not text.strip():
        raise CliError("no text to speak (give it as an argument or on stdin)")
    return text


def _read_file(path: str | None) -> bytes | None:
    if path is None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise CliError(f"{path}: {e}") from None


async def _say(args: argparse.Namespace, gateway: GatewayConfig) -> int:
    import soundfile

    text = _read_text(args)
    if (args.prompt_wav is None) != (args.prompt_text is None):
        raise CliError("--prompt-wav and --prompt-text go together")
    if args.server:
        audio, rate, ttfb_s, wall_s, demo = await _say_remote(args, text)
    else:
        audio, rate, ttfb_s, wall_s, demo = await _say_local(args, text)
    soundfile.write(args.output, audio, rate, subtype="PCM_16")
    seconds = len(audio) / rate
    rtf = wall_s / seconds if seconds else float("nan")
    print(f"wrote {args.output}: {seconds:.2f} s at {rate} Hz; TTFB {ttfb_s * 1000:.0f} ms, RTF {rtf:.3f}"
          + ("  [tiny demo model: the audio is NOT speech]" if demo else ""))
    return 0


async def _say_local(args: argparse.Namespace, text: str) -> tuple[np.ndarray, int, float, float, bool]:
    import numpy as np

    from engine import EngineError

    engine = await _start_engine(args)
    try:
        kwargs: dict = {"cfg_value": args.cfg, "seed": args.seed}
        if args.prompt_wav:
            kwargs.update(prompt_audio=_read_file(args.prompt_wav), prompt_text=args.prompt_text)
        if args.reference_wav:
            kwargs["reference_audio"] = _read_file(args.reference_wav)
        if args.instruction:
            kwargs["instruction"] = args.instruction
        chunks: list[np.ndarray] = []
        t0 = time.perf_counter()
        ttfb = 0.0
        try:
            async for chunk in engine.generate(spoken.normalize(text, args.normalize), **kwargs):
                if not chunks:
                    ttfb = time.perf_counter() - t0
                chunks.append(chunk.audio)
        except EngineError as e:
            raise CliError(str(e)) from None
        wall = time.perf_counter() - t0
        info = engine.model_info()
        audio = np.concatenate(chunks) if chunks else np.zeros(0, np.float32)
        return audio, info.sample_rate, ttfb, wall, info.is_demo
    finally:
        await engine.stop()


async def _say_remote(args: argparse.Namespace, text: str) -> tuple[np.ndarray, int, float, float, bool]:
    import aiohttp
    import numpy as np

    from gateway.client import ServerError, VoxgateClient

    base = args.server.rstrip("/")
    http = base.replace("ws://", "http://", 1).replace("wss://", "https://", 1)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    voice = None
    ref = args.prompt_wav or args.reference_wav
    if ref:  # the gateway speaks stored voices: upload the prompt first
        async with aiohttp.ClientSession(headers=headers) as http_session:
            params = {"text": args.prompt_text} if args.prompt_text else {}
            async with http_session.post(f"{http}/v1/voices", data=_read_file(ref), params=params) as r:
                body = await r.json()
                if r.status != 201:
                    raise CliError(f"voice upload failed: {body.get('error', body)}")
                voice = body["voice_id"]
    rate = 48000
    try:
        client = await VoxgateClient.connect(f"{base}/v1/stream", api_key=args.api_key)
    except Exception as e:
        raise CliError(f"cannot connect to {base}/v1/stream: {e}") from None
    async with client:
        try:
            started = await client.start(voice=voice, output={"format": "pcm_s16le", "sample_rate": rate},
                                         generation={"cfg_value": args.cfg, "seed": args.seed,
                                                     "normalize": args.normalize, "instruction": args.instruction})
            t0 = time.perf_counter()
            utt = await client.speak(text, "say", timeout=600)
        except ServerError as e:
            raise CliError(f"server: {e}") from None
        wall = time.perf_counter() - t0
    pcm = np.frombuffer(b"".join(utt.payloads), dtype="<i2").astype(np.float32) / 32768.0
    demo = bool(started.get("model", {}).get("demo"))
    if demo:
        log.warning(DEMO_WARNING)
    return pcm, rate, (utt.ttfb_ms or 0.0) / 1000.0, wall, demo


if __name__ == "__main__":
    sys.exit(main())
