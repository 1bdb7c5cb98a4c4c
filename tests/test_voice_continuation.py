"""A stored voice with the session's continuation prompt: a VoxCPM2 reference voice takes the official reference +
continuation layout (`[103, ref, 104, prompt_text + text, 101, prompt patches]`, its reference KV still shared), and
equals the official package on the same weights and noise; a VoxCPM 0.5B/1.5 prompt voice stays every segment's
prompt. The gateway test drives a real server with a real client and the real tiny engine."""

import contextlib
import io

import aiohttp
import numpy as np
import pytest
import pytest_asyncio
import soundfile as sf
import torch
from engine_calls import recorded_calls
from oracle import injected_noise

from engine.errors import InvalidParameter
from engine.request import Request
from gateway.client import VoxgateClient
from gateway.server import ServerConfig, create_app, start_server

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(180)]

TEXT, PROMPT_TEXT, SEED, MAX_LEN = "Hello world, this is a test.", "Please call me back.", 3, 6
LONG_TURN = "The first clause is here, and then a second sentence follows. A third one ends it."


def _wav(seconds: float, freq: float) -> bytes:
    """16 kHz float WAV (the tiny VAE's input rate: nobody resamples) of a length that needs padding."""
    t = np.arange(int(seconds * 16000)) / 16000
    buf = io.BytesIO()
    sf.write(buf, (0.3 * np.sin(2 * np.pi * freq * t * (1 + t))).astype(np.float32), 16000, format="WAV",
             subtype="FLOAT")
    return buf.getvalue()


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def v1_engine(tiny_v1_dir):
    from engine import Engine

    eng = Engine.from_pretrained(str(tiny_v1_dir), max_num_seqs=4)
    await eng.wait_for_ready()
    yield eng
    await eng.stop()


async def test_reference_voice_with_continuation_equals_the_official_layout(engine, tiny_v2_dir, tmp_path):
    from voxcpm.model.voxcpm2 import VoxCPM2Model

    ref_wav, prompt_wav = _wav(0.4, 150), _wav(0.55, 220)
    (tmp_path / "ref.wav").write_bytes(ref_wav)
    (tmp_path / "prompt.wav").write_bytes(prompt_wav)
    voice = await engine.add_voice(audio=ref_wav, voice_id="ref-cont")
    prompt_latents = await engine.encode_audio(prompt_wav)
    gen = engine.generate(TEXT, voice=voice, prompt_latents=prompt_latents, prompt_text=PROMPT_TEXT, seed=SEED,
                          max_length=MAX_LEN, timesteps=4)
    spec = gen._spec  # the request as it went to the worker
    ours = np.concatenate([c.audio async for c in gen])
    assert spec.voice_id == voice  # the reference's KV is the voice's shared prefix

    with contextlib.redirect_stderr(io.StringIO()):
        official = VoxCPM2Model.from_local(str(tiny_v2_dir), optimize=False, device="cpu")
    seen = {}
    inference = official._inference

    def recording(text_token, text_mask, feat, feat_mask, **kw):
        seen.update(ids=text_token[0].tolist(), audio_mask=feat_mask[0].tolist(), feat=feat[0].float())
        return inference(text_token, text_mask, feat, feat_mask, **kw)

    official._inference = recording
    gen_noise = torch.Generator().manual_seed(SEED)  # the engine's rule: step i takes the i-th draw
    noise = [torch.randn(1, 64, official.patch_size, generator=gen_noise) for _ in range(MAX_LEN)]
    with injected_noise(official, noise), contextlib.redirect_stderr(io.StringIO()):
        theirs = official.generate(target_text=TEXT, prompt_text=PROMPT_TEXT,
                                   prompt_wav_path=str(tmp_path / "prompt.wav"),
                                   reference_wav_path=str(tmp_path / "ref.wav"), inference_timesteps=4,
                                   max_len=MAX_LEN, retry_badcase=False)[0].numpy()

    assert spec.token_ids == seen["ids"]
    assert spec.token_ids[0] == 103 and 104 in spec.token_ids and 101 in spec.token_ids
    assert list(spec.audio_mask) == [int(m) for m in seen["audio_mask"]]
    assert torch.allclose(Request(spec).patches, seen["feat"], atol=1e-5)  # the worker's prompt tensors
    assert ours.shape == theirs.shape
    rel = np.abs(ours - theirs).max() / np.abs(theirs).max()
    assert rel < 2e-4, f"engine vs official reference + continuation: relative error {rel:.2e}"
    await engine.remove_voice(voice)


async def test_prompt_voice_takes_no_other_prompt(v1_engine):
    voice = await v1_engine.add_voice(audio=_wav(0.3, 200), text="A prompt voice.")
    latents = await v1_engine.encode_audio(_wav(0.3, 260))
    with pytest.raises(InvalidParameter, match="prompt voice"):
        v1_engine.generate(TEXT, voice=voice, prompt_latents=latents, prompt_text="Before.")
    with pytest.raises(InvalidParameter, match="reference audio"):
        v1_engine.generate(TEXT, voice=voice, reference_latents=latents)


async def _three_segments(engine, voice_audio: bytes, voice_text: str | None) -> tuple[list, dict, str]:
    """A 3-segment turn with a stored voice over the native socket: (the engine requests, context.done, voice id)."""
    runner, port = await start_server(create_app(engine, ServerConfig(web_client_dir=None)))
    try:
        async with aiohttp.ClientSession() as http:
            data = aiohttp.FormData()
            data.add_field("audio", voice_audio, filename="v.wav")
            if voice_text:
                data.add_field("text", voice_text)
            async with http.post(f"http://127.0.0.1:{port}/v1/voices", data=data) as r:
                assert r.status == 201, await r.text()
                voice = (await r.json())["voice_id"]
        with recorded_calls(engine) as calls:
            async with await VoxgateClient.connect(f"ws://127.0.0.1:{port}/v1/stream") as c:
                await c.start(voice=voice, output={"format": "pcm_s16le"}, generation={"seed": SEED, "max_length": 4})
                utt = await c.speak(LONG_TURN, "t")
                if voice_text:  # a prompt voice is the prompt: a style instruction never comes with one
                    await c.update(generation={"instruction": "cheerful"})
                    reply = await c.recv(10)
                    assert reply["type"] == "error" and reply["code"] == "invalid_value", reply
                    assert "prompt voice" in reply["message"]
    finally:
        await runner.cleanup()
    errors = [e for e in utt.events if e["type"] == "error"]
    assert not errors, errors
    segments = [e for e in utt.events if e["type"] == "segment.started"]
    assert len(segments) == 3 == len(calls)
    assert " ".join(s["text"] for s in segments) == LONG_TURN
    return calls, utt.done, voice


async def test_three_segment_turn_with_a_reference_voice_continues(engine):
    calls, done, voice = await _three_segments(engine, _wav(0.4, 150), None)
    assert all(kw["voice"] == voice for _, kw in calls)
    assert "prompt_latents" not in calls[0][1]
    for (before, _), (_, kw) in zip(calls, calls[1:], strict=False):
        assert kw["prompt_text"] == before  # continues from the previous segment's text and audio
        assert kw["prompt_latents"].ndim == 3 and len(kw["prompt_latents"]) >= 1
    assert done["audio_ms"] > 0


async def test_three_segment_turn_with_a_prompt_voice_keeps_its_own_prompt(v1_engine):
    calls, done, voice = await _three_segments(v1_engine, _wav(0.3, 200), "A prompt voice.")
    assert all(kw["voice"] == voice and "prompt_latents" not in kw for _, kw in calls)
    assert done["audio_ms"] > 0


async def test_a_designed_voice_on_voxcpm1_is_a_prompt_voice_of_its_sample(v1_engine):
    from gateway.auth import Caller
    from gateway.store import open_store
    from gateway.voice_design import Design
    from gateway.voices import Catalog

    made = await Catalog(v1_engine, open_store(None, None)).create_voice(
        Caller("k", "tenant-k"), design=Design("a calm voice", "A short sample.", seed=SEED))
    assert made["mode"] == "prompt" and made["text"] == "A short sample." and made["description"] == "a calm voice"
    audio = [c.audio async for c in v1_engine.generate("Spoken with it.", voice=made["voice_id"], seed=SEED,
                                                       max_length=3)]
    assert audio
    await v1_engine.remove_voice(made["voice_id"])
