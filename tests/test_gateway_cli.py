"""The `voxgate` command as a user runs it (subprocesses): say locally, say through a gateway (without torch),
serve + SIGTERM, --help (without torch or numpy)."""

import argparse
import asyncio
import os
import signal
import socket
import sys

import aiohttp
import pytest
import pytest_asyncio
import soundfile

from engine import Engine
from gateway.client import VoxgateClient
from gateway.server import ServerConfig, create_app, start_server

pytestmark = pytest.mark.timeout(120)
in_module_loop = pytest.mark.asyncio(loop_scope="module")  # the module-scoped gateway fixture's loop

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


async def _voxgate(*args: str, timeout: float = 90) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "gateway.cli", *args, env=ENV,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await asyncio.wait_for(proc.communicate(), timeout)
    return proc.returncode, out.decode()


async def _voxgate_imports(*args: str, timeout: float = 90) -> tuple[int, str, set[str]]:
    """`_voxgate` under `python -X importtime`: also the names of every module the command imported."""
    proc = await asyncio.create_subprocess_exec(sys.executable, "-X", "importtime", "-m", "gateway.cli", *args,
                                                env=ENV, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), timeout)
    modules: set[str] = set()
    messages = [out.decode()]
    for line in err.decode().splitlines():
        if line.startswith("import time:"):
            modules.add(line.rpartition("|")[2].strip())
        else:
            messages.append(line)
    return proc.returncode, "\n".join(messages), modules


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def gateway_url(tiny_v2_dir):
    engine = Engine.from_pretrained(str(tiny_v2_dir), max_num_seqs=4)
    await engine.wait_for_ready()
    runner, port = await start_server(create_app(engine, ServerConfig(web_client_dir=None)))
    yield f"ws://127.0.0.1:{port}"
    await runner.cleanup()
    await engine.stop()


@in_module_loop
async def test_say_locally_writes_a_wav_and_reports_ttfb_and_rtf(tiny_v2_dir, tmp_path):
    out = tmp_path / "local.wav"
    code, text = await _voxgate("say", "Hello there.", "-o", str(out), "--model", str(tiny_v2_dir), "--seed", "1")
    assert code == 0, text
    audio, rate = soundfile.read(out)
    assert rate == 48000 and len(audio) > 0
    assert "TTFB" in text and "RTF" in text


@in_module_loop
async def test_say_through_the_gateway(gateway_url, tmp_path):
    out = tmp_path / "remote.wav"
    code, text, modules = await _voxgate_imports("say", "Hello through the gateway.", "-o", str(out),
                                                 "--server", gateway_url)
    assert code == 0, text
    audio, rate = soundfile.read(out)
    assert rate == 48000 and len(audio) > 0 and "TTFB" in text
    assert "gateway.client" in modules and "torch" not in modules  # the engine runs in the gateway, not here


@in_module_loop
async def test_say_with_a_style_instruction(gateway_url, tiny_v2_dir, tmp_path):
    out = tmp_path / "styled.wav"
    code, text = await _voxgate("say", "Hello in style.", "-o", str(out), "--server", gateway_url,
                                "--instruction", "warm and slow")
    assert code == 0, text
    assert len(soundfile.read(out)[0]) > 0
    wav = tmp_path / "prompt.wav"
    soundfile.write(wav, [0.1] * 8000, 16000)
    code, text = await _voxgate("say", "Hi.", "-o", str(out), "--model", str(tiny_v2_dir), "--instruction", "warm",
                                "--prompt-wav", str(wav), "--prompt-text", "A prompt.")
    assert code == 2 and "instruction" in text and "Traceback" not in text


@in_module_loop
async def test_say_reports_bad_input_without_a_traceback(gateway_url, tmp_path):
    code, text = await _voxgate("say", "  ", "-o", str(tmp_path / "x.wav"), "--server", gateway_url)
    assert code == 2 and "no text" in text and "Traceback" not in text
    code, text = await _voxgate("say", "Hi.", "-o", str(tmp_path / "x.wav"), "--server", "ws://127.0.0.1:9")
    assert code == 2 and "cannot connect" in text and "Traceback" not in text


@in_module_loop
@pytest.mark.parametrize("group", [False, True], ids=["main-process", "process-group"])
async def test_serve_answers_and_shuts_down_cleanly_on_sigterm(tiny_v2_dir, tmp_path, group):
    """SIGTERM to the main process, or to every process of the service at once (systemd's default KillMode, a
    terminal's Ctrl-C): the server drains; its engine worker and encoder processes wait for it, none is restarted."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway.cli", "serve", "--model", str(tiny_v2_dir), "--host", "127.0.0.1",
        "--port", str(port), "--shutdown-timeout", "0.5", "--max-num-seqs", "4", "--data-dir", str(tmp_path),
        env=ENV, start_new_session=True,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    try:
        banner = b""
        while b"serving" not in banner:
            line = await asyncio.wait_for(proc.stderr.readline(), 60)
            assert line, "the server exited before serving"
            banner += line
        async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{port}/v1/models") as r:
            assert r.status == 200  # the compat protocols are served too
        async with await VoxgateClient.connect(f"ws://127.0.0.1:{port}/v1/stream") as c:
            await c.start(output={"format": "pcm_s16le"})
            utt = await c.speak("Served.", "t")
            assert utt.done["audio_ms"] > 0
            await c.append("A turn left open when the server stops", "open")
            if group:
                os.killpg(proc.pid, signal.SIGTERM)
            else:
                proc.send_signal(signal.SIGTERM)
            error = await c.expect("error", timeout=20)
            assert error["code"] == "server_shutdown" and error["fatal"] is True
        assert await asyncio.wait_for(proc.wait(), 30) == 0
        log = (banner + await proc.stderr.read()).decode()
        assert "restarting" not in log and "lost" not in log and "Traceback" not in log, log
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


@pytest.mark.parametrize("args", [["--help"], ["serve", "--help"]])
async def test_help_starts_without_torch_or_numpy(args):
    code, text, modules = await _voxgate_imports(*args)
    assert code == 0 and "usage: voxgate" in text, text
    assert "gateway.flags" in modules and "engine.engine_config" in modules  # the flag tables were built
    assert not {"torch", "numpy", "engine.engine"} & modules  # each of them adds to every `voxgate --help`
    if args[0] == "serve":
        assert "--max-num-seqs" in text and "--max-sessions" in text  # engine and gateway flags, from their configs


def test_engine_switches_reach_the_engine_only_when_set():
    from gateway.cli import _engine_kwargs, _parser

    assert _engine_kwargs(_parser().parse_args(["serve"])) == {}
    args = _parser().parse_args(["serve", "--split-decodes-above", "0", "--no-merge-lora", "--vae-dtype", "bfloat16",
                                 "--fp8-prefill", "--fp8-dit"])
    assert _engine_kwargs(args) == {"split_decodes_above": None, "merge_lora": False, "vae_dtype": "bfloat16",
                                    "fp8_prefill": True, "fp8_dit": True}
    assert _engine_kwargs(_parser().parse_args(["serve", "--split-decodes-above", "200"])) == {
        "split_decodes_above": 200}


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return {name: p for a in parser._actions if isinstance(a, argparse._SubParsersAction)
            for name, p in a.choices.items()}


def test_every_flag_of_every_subcommand_has_help_text():
    from gateway.cli import _parser

    parser = _parser()
    commands = _subcommands(parser)
    assert {"serve", "say"} <= set(commands)
    for name, sub in [("voxgate", parser), *commands.items()]:
        for action in sub._actions:
            if action.option_strings or name != "voxgate":  # the subcommand choice itself is listed in its help
                assert action.help and action.help.strip(), f"{name} {'/'.join(action.option_strings)}: no help text"


def test_version_prints_the_installed_version(capsys):
    from importlib.metadata import version

    from gateway.cli import main

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"voxgate {version('voxgate')}"


async def test_serve_refuses_a_bad_switch_before_starting(tmp_path):
    """A VOXGATE_* switch that holds a value it does not take stops `voxgate serve` at once, naming it (not the
    first Opus turn, where the encode site reads it)."""
    env = {**ENV, "VOXGATE_ENCODE_PROCS": "lots"}
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "gateway.cli", "serve", "--port", "0",
                                                "--data-dir", str(tmp_path), env=env,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 2, out.decode()
    assert "VOXGATE_ENCODE_PROCS='lots'" in out.decode() and "auto" in out.decode()
    assert "Traceback" not in out.decode()
