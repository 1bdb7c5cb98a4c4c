"""Every client snippet in docs/INTEGRATIONS.md, run against a real server on the real tiny engine (its URL and
key put in): the LiveKit and Pipecat snippets' `tts` speaks a text through the framework, the SDK snippets'
`speak(text)` returns the audio. A snippet that drifts from the code fails here."""

import logging
import re
from pathlib import Path

import numpy as np
import pytest
import pytest_asyncio
from compat_support import (
    compat_server,
    livekit_audio,
    livekit_synthesize,
    run_tts,
    spoken_audio,
)

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]

KEY = "snippet-key"
VOICE = "21m00Tcm4TlvDq8ikWAM"  # an ElevenLabs voice id: not stored here, so the default voice speaks
RATE = 24000
TEXT = "Hi there."
DOC = Path(__file__).resolve().parents[1] / "docs" / "INTEGRATIONS.md"
SNIPPET = re.compile(r"<!-- snippet: (\S+) -->\n```python\n(.*?)```", re.S)
FRAMEWORKS = ("livekit", "pipecat")
CLIENTS = ("elevenlabs", "cartesia", "deepgram", "openai")


def _snippets() -> dict[str, str]:
    return dict(SNIPPET.findall(DOC.read_text()))


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def port(engine):
    async with compat_server(engine, KEY) as port:
        yield port


def _run(name: str, port: int) -> dict:
    """The snippet's namespace, once run with this server's URL and key (and a voice id)."""
    source = (_snippets()[name].replace("http://localhost:8080", f"http://127.0.0.1:{port}")
              .replace("ws://localhost:8080", f"ws://127.0.0.1:{port}").replace("<voxgate key>", KEY)
              .replace("<voice id>", VOICE))
    namespace: dict = {}
    exec(compile(source, f"{DOC.name}:{name}", "exec"), namespace)
    return namespace


async def test_each_framework_and_sdk_has_one_snippet():
    assert sorted(_snippets()) == sorted(f"{kind}-{client}" for kind in (*FRAMEWORKS, "sdk") for client in CLIENTS)


@pytest.mark.parametrize("client", CLIENTS)
async def test_livekit_snippet_speaks_without_warnings(port, client, caplog):
    from livekit.agents.utils import http_context

    caplog.set_level(logging.WARNING, logger="livekit")
    async with http_context.open():  # what a LiveKit job provides to its plugins
        tts = _run(f"livekit-{client}", port)["tts"]
        try:
            samples = livekit_audio(await livekit_synthesize(tts, TEXT), RATE)
        finally:
            await tts.aclose()
    assert len(samples) / RATE > 0.1
    assert not [r for r in caplog.records if r.name.startswith("livekit")], caplog.text  # e.g. no request id


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # pipecat's own
@pytest.mark.parametrize("client", CLIENTS)
async def test_pipecat_snippet_speaks(port, client):
    from pipecat.frames.frames import TTSSpeakFrame

    tts = _run(f"pipecat-{client}", port)["tts"]
    frames = await run_tts(tts, [TTSSpeakFrame(TEXT)], RATE)
    assert sum(len(f.audio) for f in spoken_audio(frames, RATE)) / 2 / RATE > 0.1


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # deepgram-sdk's own (websockets.legacy)
@pytest.mark.parametrize("client", CLIENTS)
async def test_sdk_snippet_speaks(port, client):
    audio = await _run(f"sdk-{client}", port)["speak"](TEXT)
    samples = np.frombuffer(audio, dtype="<i2").astype(np.float32) / 32768.0
    assert len(audio) % 960 == 0 and len(samples) / RATE > 0.1  # whole 20 ms frames of 24 kHz s16le
    assert np.sqrt(np.mean(samples ** 2)) > 1e-4  # audible
