"""LiveKit Agents' own streaming TTS plugins (elevenlabs, cartesia, deepgram) pointed at a real voxgate server (the
real tiny engine), driven as an agent drives them: `stream()` fed a reply's tokens, flushed and ended; the audio
checked as LiveKit plays it, and the aligned transcript LiveKit builds from our timestamps. (`synthesize()` of all
four plugins, openai's included, runs in tests/test_integration_snippets.py, from the documented snippets.)"""

import logging

import aiohttp
import pytest
import pytest_asyncio
from compat_support import compat_server, livekit_audio, livekit_stream, livekit_transcript

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]

KEY = "lk-test-key"
RATE = 24000
REPLY = ["Hello", " there", ".", " How", " are", " you", "?"]  # an agent's reply, token by token


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def port(engine):
    async with compat_server(engine, KEY) as port:
        yield port


@pytest_asyncio.fixture(loop_scope="module")
async def http():
    async with aiohttp.ClientSession() as session:
        yield session


def _plugin(name: str, port: int, http: aiohttp.ClientSession):
    """A LiveKit plugin's TTS with only its base URL pointed at voxgate."""
    base = f"http://127.0.0.1:{port}"
    if name == "elevenlabs":
        from livekit.plugins import elevenlabs

        return elevenlabs.TTS(api_key=KEY, base_url=f"{base}/v1", http_session=http, encoding=f"pcm_{RATE}")
    if name == "cartesia":
        from livekit.plugins import cartesia

        return cartesia.TTS(api_key=KEY, base_url=base, http_session=http, sample_rate=RATE)
    from livekit.plugins import deepgram

    return deepgram.TTS(api_key=KEY, base_url=f"{base}/v1/speak", http_session=http, sample_rate=RATE)


@pytest.mark.parametrize("name", ["elevenlabs", "cartesia"])
async def test_stream_aligned_transcript_follows_the_audio_and_never_goes_back(port, http, name, caplog):
    caplog.set_level(logging.WARNING, logger="livekit")
    tts = _plugin(name, port, http)
    try:
        assert tts.capabilities.streaming and tts.capabilities.aligned_transcript
        events = await livekit_stream(tts, REPLY)
    finally:
        await tts.aclose()
    seconds = len(livekit_audio(events, RATE)) / RATE
    words = livekit_transcript(events)
    assert "".join(words).split() == "".join(REPLY).split()
    starts = [w.start_time for w in words]
    assert starts == sorted(starts) and all(w.start_time < w.end_time for w in words)
    assert starts[0] == 0.0 and words[-1].end_time == pytest.approx(seconds, abs=0.05)  # ends with the audio
    assert not [r for r in caplog.records if r.name.startswith("livekit")], caplog.text


async def test_deepgram_stream_speaks_the_reply(port, http, caplog):
    caplog.set_level(logging.WARNING, logger="livekit")
    tts = _plugin("deepgram", port, http)
    try:
        events = await livekit_stream(tts, REPLY)
    finally:
        await tts.aclose()
    assert len(livekit_audio(events, RATE)) / RATE > 0.2
    assert not [r for r in caplog.records if r.name.startswith("livekit")], caplog.text
