"""The `voxgate` command: `voxgate serve` (the gateway) and `voxgate say` (one utterance to a WAV file)."""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import signal
import sys
import time
from pathlib import Path

import numpy as np

from gateway.config_file import ConfigFileError, with_config_file
from gateway.leases import DEFAULT_LEASE_TTL_S
from gateway.store.local import DEFAULT_DATA_DIR
from gateway.text import normalize as spoken

log = logging.getLogger("voxgate")

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
    _setup_logging(args.log_level, args.log_json)
    try:
        return asyncio.run(args.run(args))
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
        p.add_argument("--log-level", default="warning", help="debug, info, warning (default), error")
        p.add_argument("--log-json", action="store_true", help="one JSON object per log line")

    def engine_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--model", help="model directory or Hugging Face id (default: VoxCPM2 on a GPU, else the "
                                       "tiny demo model)")
        p.add_argument("--devices", help="CUDA device indices, e.g. 0,1 (one engine worker per GPU, or per group of "
                       "--tensor-parallel-size GPUs); cpu,cpu: two CPU workers")
        p.add_argument("--tensor-parallel-size", type=int, default=1,
                       help="GPUs per engine worker: the LMs and LocDiT split across them (default 1)")
        p.add_argument("--max-num-seqs", type=int, default=None, help="concurrent requests per worker")
        p.add_argument("--timesteps", type=int, default=None, help="diffusion steps per patch (default 10)")
        p.add_argument("--max-timesteps", type=int, default=None,
                       help="the most diffusion steps a request may ask for (default: --timesteps). Fewer than "
                            "--timesteps cost nothing; a request above it adds a short tail (its extra LocDiT "
                            "evaluations, for its own rows only) to the steps it is in")
        p.add_argument("--vae-dtype", choices=("float32", "bfloat16"), default="float32",
                       help="the audio decoder's precision: bfloat16 is faster at scale, with ~2.7%% relative audio "
                            "error (default float32, as the official code)")
        p.add_argument("--split-decodes-above", type=int, default=None,
                       help="more speaking streams than this (per worker) decode in two halves taking turns: "
                            "first audio ~2x sooner at high load, each stream still a patch every two steps "
                            "(0: never split; default: the engine's)")
        p.add_argument("--max-loras", type=int, default=None,
                       help="LoRA adapters resident on each worker at once (default 0: no adapters can be registered)")
        p.add_argument("--max-lora-rank", type=int, default=None, help="the largest adapter rank accepted")
        p.add_argument("--no-merge-lora", action="store_true",
                       help="always the batched LoRA kernels; by default steps whose streams all use one adapter run "
                            "it merged into the weights (base-model speed, ~0.8 GB more GPU memory for VoxCPM2)")
        p.add_argument("--fp8-prefill", action="store_true",
                       help="run the LMs' large prefill GEMMs (bursts of prompts, long prompts) in FP8: ~1.5x "
                            "faster GEMMs (a burst of prompts gets its first audio sooner), for FP8 rounding "
                            "in the prompts' KV cache and ~1.7 GB more GPU memory for VoxCPM2; needs an Ada or Hopper "
                            "GPU; not with LoRA or tensor parallelism")
        p.add_argument("--fp8-dit", action="store_true",
                       help="run the LocDiT's GEMMs of busy steps (~47+ streams) in FP8: more streams per GPU, with "
                            "FP8 rounding in every patch of those steps; needs an Ada or Hopper GPU; not with LoRA "
                            "or tensor parallelism")

    serve = sub.add_parser("serve", help="run the gateway")
    engine_args(serve)
    serve.add_argument("--host", default="0.0.0.0",
                       help="address to listen on (default 0.0.0.0: every interface; 127.0.0.1: this machine only)")
    serve.add_argument("--port", type=int, default=8080, help="TCP port to listen on (default %(default)s)")
    serve.add_argument("--api-keys-file", help="file with one API key per line, optionally followed by flags: "
                       "operator (shares voices and adapters with every key, manages all), strict (unknown voice "
                       "ids are not-found errors) (default: no authentication)")
    serve.add_argument("--data-dir", help="where stored voices and LoRA adapters are kept across restarts, for one "
                       f"server (default: {DEFAULT_DATA_DIR}; many nodes share state with --store instead)")
    serve.add_argument("--store", metavar="URL", help="shared state for many nodes: redis://host:port/db holds "
                       "voices, adapters, tokens and per-key session leases (default: the local --data-dir)")
    serve.add_argument("--api-keys-from-store", action="store_true",
                       help="also accept the keys in the store's voxgate:keys hash (key -> flags), re-read every "
                            "few seconds: keys are added and revoked without a restart (needs --store)")
    serve.add_argument("--session-lease-ttl", type=float, default=DEFAULT_LEASE_TTL_S,
                       help="seconds a per-key session place outlives a node that died without giving it back "
                            "(the node refreshes its places every third of it; default %(default)s)")
    serve.add_argument("--strict-voices", action="store_true",
                       help="ElevenLabs, Cartesia and Deepgram requests naming an unknown voice get the protocol's "
                            "not-found error (default: they speak with the default voice, logged)")
    serve.add_argument("--metrics-key-file", help="file whose first line is the key GET /metrics requires as "
                       "'Authorization: Bearer <key>' (default: /metrics is open; /healthz and /readyz always are)")
    serve.add_argument("--max-sessions", type=int, default=1000,
                       help="concurrent sessions (WebSocket or HTTP) this server accepts; more are refused with "
                            "an 'overloaded' error (default %(default)s)")
    serve.add_argument("--max-sessions-per-key", type=int, default=100,
                       help="concurrent sessions per API key, with --api-keys-file (default %(default)s)")
    serve.add_argument("--max-queued-per-key", type=int, default=None,
                       help="prompts of one API key waiting for their first audio at most; more are refused with "
                            "rate_limited (default: no limit; prefill is shared fairly between keys either way)")
    serve.add_argument("--idle-timeout", type=float, default=60.0, help="seconds without a message (default 60)")
    serve.add_argument("--shutdown-timeout", type=float, default=10.0,
                       help="seconds turns may take to finish on SIGTERM (default 10)")
    serve.add_argument("--web-client",
                       help="folder of the browser client to serve at / (default: the demo page, gateway/web_client/)")
    serve.add_argument("--config", help="TOML file of serve settings, keyed by these flags' names (max-sessions = "
                                        "500; deploy/voxgate.toml lists them all); flags given here override it")
    common(serve)
    serve.set_defaults(run=_serve)

    say = sub.add_parser("say", help="speak a text into a WAV file")
    say.add_argument("text", nargs="?", help="the text (default: read stdin)")
    say.add_argument("-o", "--output", required=True, help="output WAV file")
    engine_args(say)
    say.add_argument("--prompt-wav", help="voice prompt audio (continuation: also give --prompt-text)")
    say.add_argument("--prompt-text", help="transcript of --prompt-wav")
    say.add_argument("--reference-wav", help="reference voice audio (VoxCPM2)")
    say.add_argument("--instruction", help="style instruction, VoxCPM2 voice design (\"warm female voice, slow\"): "
                     "spoken as (instruction)text, as `voxcpm design --control`; not with --prompt-wav")
    say.add_argument("--server", help="speak through a running gateway, e.g. ws://127.0.0.1:8080")
    say.add_argument("--api-key", help="API key for --server")
    say.add_argument("--seed", type=int, default=None,
                     help="random seed: the same seed, text and voice give the same audio (default: a new one)")
    say.add_argument("--cfg", type=float, default=2.0,
                     help="classifier-free guidance: higher follows the text and voice more closely (default "
                          "%(default)s)")
    say.add_argument("--normalize", choices=spoken.MODES, default="auto",
                     help="numbers, money, dates and units spoken as words (docs/PROTOCOL.md, generation.normalize)")
    common(say)
    say.set_defaults(run=_say)
    return ap


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {"time": round(record.created, 3), "level": record.levelname.lower(), "logger": record.name,
                 "message": record.getMessage()}
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def _setup_logging(level: str, as_json: bool) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(_JsonFormatter() if as_json else
                         logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    numeric = getattr(logging, level.upper(), None)
    if not isinstance(numeric, int):
        raise SystemExit(f"voxgate: error: unknown --log-level {level!r}")
    logging.basicConfig(level=numeric, handlers=[handler], force=True)
    logging.getLogger("aiohttp.access").setLevel(max(numeric, logging.WARNING))


def _engine_kwargs(args: argparse.Namespace) -> dict:
    kwargs: dict = {}
    if args.devices:
        try:
            kwargs["devices"] = [d.strip() if d.strip() == "cpu" else int(d) for d in args.devices.split(",")]
        except ValueError:
            raise CliError(f"--devices {args.devices!r}: expected indices like 0,1 (or cpu)") from None
    if args.tensor_parallel_size != 1:
        kwargs["tensor_parallel_size"] = args.tensor_parallel_size
    if args.max_num_seqs:
        kwargs["max_num_seqs"] = args.max_num_seqs
    if args.timesteps:
        kwargs["inference_timesteps"] = args.timesteps
    if args.max_timesteps is not None:  # 0 or below the default: the engine's clear error, not ignored
        kwargs["max_timesteps"] = args.max_timesteps
    if args.vae_dtype != "float32":
        kwargs["vae_dtype"] = args.vae_dtype
    if args.split_decodes_above is not None:
        kwargs["split_decodes_above"] = args.split_decodes_above or None
    if args.max_loras is not None:
        kwargs["max_loras"] = args.max_loras
    if args.max_lora_rank is not None:
        kwargs["max_lora_rank"] = args.max_lora_rank
    if args.no_merge_lora:
        kwargs["merge_lora"] = False
    if args.fp8_prefill:
        kwargs["fp8_prefill"] = True
    if args.fp8_dit:
        kwargs["fp8_dit"] = True
    if getattr(args, "max_queued_per_key", None) is not None:  # `serve` only: `say` has one request
        kwargs["max_queued_per_tenant"] = args.max_queued_per_key
    return kwargs


async def _start_engine(args: argparse.Namespace):
    from engine import Engine, EngineError

    try:
        engine = Engine.from_pretrained(args.model, **_engine_kwargs(args))
        await engine.wait_for_ready()
    except (EngineError, OSError, ValueError) as e:
        raise CliError(f"cannot start the engine: {e}") from None
    info = engine.model_info()
    if info.is_demo:
        log.warning(DEMO_WARNING)
    return engine


async def _serve(args: argparse.Namespace) -> int:
    from gateway.auth import Auth
    from gateway.http.readiness import drain
    from gateway.protocol import Limits
    from gateway.server import WEB_CLIENT_DIR, ServerConfig, create_app, start_server
    from gateway.session import SessionConfig
    from gateway.store import open_store

    try:
        auth = Auth.from_file(args.api_keys_file, keys_from_store=args.api_keys_from_store) \
            if args.api_keys_file else Auth(keys_from_store=args.api_keys_from_store)
    except (OSError, ValueError) as e:
        raise CliError(f"--api-keys-file: {e}") from None
    if args.api_keys_from_store and not args.store:
        raise CliError("--api-keys-from-store needs --store redis://...")
    try:
        store = open_store(args.store, None if args.store else Path(args.data_dir or DEFAULT_DATA_DIR))
    except (OSError, ValueError) as e:
        raise CliError(f"--data-dir / --store: {e}") from None
    print(f"voxgate: stored voices and adapters: {store.description}", file=sys.stderr)
    if not auth.enabled:
        log.warning("no --api-keys-file: every client may connect (fine on localhost or a trusted network)")
    metrics_key = _first_line(args.metrics_key_file, "--metrics-key-file") if args.metrics_key_file else None
    config = ServerConfig(session=SessionConfig(limits=Limits(idle_timeout_s=args.idle_timeout)),
                          max_sessions=args.max_sessions, max_sessions_per_key=args.max_sessions_per_key,
                          shutdown_timeout_s=args.shutdown_timeout, metrics_key=metrics_key,
                          web_client_dir=Path(args.web_client) if args.web_client else WEB_CLIENT_DIR,
                          strict_voices=args.strict_voices, lease_ttl_s=args.session_lease_ttl)
    engine = await _start_engine(args)
    try:
        app = create_app(engine, config, auth=auth, compat=True, store=store,
                         restore_progress=lambda line: print(f"voxgate: {line}", file=sys.stderr))
        runner, port = await start_server(app, args.host, args.port, shutdown_timeout_s=args.shutdown_timeout + 5)
    except OSError as e:
        await engine.stop()
        raise CliError(f"cannot listen on {args.host}:{args.port}: {e}") from None
    # what is loaded by now (torch & co., ~170k objects) is kept out of the garbage collector's reach: a full
    # collection of it pauses the event loop for 85-180 ms, long enough to be heard in every stream
    gc.collect()
    gc.freeze()
    info = engine.model_info()
    print(f"voxgate: serving {info.name} ({info.sample_rate} Hz) on http://{args.host}:{port} "
          f"(WebSocket /v1/stream)", file=sys.stderr)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    print(f"voxgate: draining (/readyz 503, new sessions refused, turns in progress get up to "
          f"{args.shutdown_timeout:g} s)", file=sys.stderr)
    await drain(app)  # still listening, so balancers see the 503s and retry refused handshakes elsewhere
    await runner.cleanup()  # then stop listening and close what is left
    await engine.stop()
    return 0


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


async def _say(args: argparse.Namespace) -> int:
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
