"""Style instructions (VoxCPM2 voice design): the text spoken is `(instruction)text` exactly as the official
`build_final_text` makes it (token ids and audio equal the official package on the same weights and noise, zero-shot
and with reference audio); in a turn only segments without a continuation prompt carry it, and it never shows in
what the client is told was spoken. OpenAI's `instructions` map onto it. Real server, real clients, tiny engine."""

import contextlib
import io

import aiohttp
import numpy as np
import openai
import pytest
import pytest_asyncio
import soundfile as sf
import torch
from compat_support import compat_server
from engine_calls import recorded_calls
from oracle import injected_noise

from engine.errors import InvalidRequest
from gateway.client import ServerError, VoxgateClient
from gateway.protocol import MAX_INSTRUCTION_CHARS

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(180)]

TEXT, STYLE, SEED, MAX_LEN, STEPS = "Hello world, this is a test.", "warm female voice, slow", 5, 6, 4
LONG_TURN = "The first clause is here, and then a second sentence follows. A third one ends it."
KEY = "sk-style"


@pytest.fixture(scope="module")
def official(tiny_v2_dir):
    from voxcpm.model.voxcpm2 import VoxCPM2Model

    with contextlib.redirect_stderr(io.StringIO()):
        return VoxCPM2Model.from_local(str(tiny_v2_dir), optimize=False, device="cpu")


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def port(engine):
    async with compat_server(engine, KEY) as p:
        yield p


def _official_run(official, text: str, reference: str | None) -> tuple[np.ndarray, list[int]]:
    """The official `generate` of `text` (the final text, instruction included): (audio, the prompt's token ids)."""
    seen: dict = {}
    inference = official._inference

    def recording(text_token, *args, **kw):
        seen["ids"] = text_token[0].tolist()
        return inference(text_token, *args, **kw)

    official._inference = recording
    gen = torch.Generator().manual_seed(SEED)  # the engine's rule: step i takes the i-th draw
    noise = [torch.randn(1, 64, official.patch_size, generator=gen) for _ in range(MAX_LEN)]
    try:
        with injected_noise(official, noise), contextlib.redirect_stderr(io.StringIO()):
            audio = official.generate(target_text=text, reference_wav_path=reference or "", inference_timesteps=STEPS,
                                      max_len=MAX_LEN, retry_badcase=False)[0].numpy()
    finally:
        del official._inference
    return audio, seen["ids"]


@pytest.mark.parametrize("mode", ["zero-shot", "reference"])
async def test_instruction_equals_the_official_final_text(official, synth, engine, tmp_path, mode):
    from voxcpm.cli import build_final_text

    reference = None
    kwargs = {}
    if mode == "reference":
        t = np.arange(7000) / 16000
        sf.write(tmp_path / "ref.wav", (0.2 * np.sin(2 * np.pi * 150 * t)).astype(np.float32), 16000,
                 subtype="FLOAT")
        reference = str(tmp_path / "ref.wav")
        kwargs["reference_audio"] = tmp_path / "ref.wav"
    theirs, ids = _official_run(official, build_final_text(TEXT, STYLE), reference)
    prompt = synth.prompt(TEXT, instruction=STYLE, **kwargs)
    assert prompt.token_ids.tolist() == ids
    plain = synth.prompt(TEXT, **kwargs).token_ids.tolist()
    assert len(ids) > len(plain)  # the instruction's own tokens, nothing else
    ours = synth.generate(TEXT, instruction=STYLE, timesteps=STEPS, max_len=MAX_LEN, seed=SEED, **kwargs)
    assert ours.shape == theirs.shape
    assert np.abs(ours - theirs).max() / np.abs(theirs).max() < 2e-4
    if mode == "zero-shot":  # the streaming engine speaks it the same
        served = np.concatenate([c.audio async for c in engine.generate(
            TEXT, instruction=STYLE, timesteps=STEPS, max_length=MAX_LEN, seed=SEED)])
        assert served.shape == ours.shape and np.abs(served - ours).max() < 1e-3


async def test_instruction_never_comes_with_a_prompt(engine):
    latents = np.zeros((2, engine.config.patch_size, engine.config.feat_dim), np.float32)
    with pytest.raises(InvalidRequest, match="instruction"):
        engine.generate(TEXT, instruction=STYLE, prompt_latents=latents, prompt_text="Before.")


async def _turn(port: int, engine, generation: dict) -> tuple[list, list]:
    with recorded_calls(engine) as calls:
        async with await VoxgateClient.connect(f"ws://127.0.0.1:{port}/v1/stream", api_key=KEY) as c:
            await c.start(output={"format": "pcm_s16le"}, generation={"seed": SEED, "max_length": 3, **generation})
            utt = await c.speak(LONG_TURN, "t")
    segments = [e for e in utt.events if e["type"] == "segment.started"]
    assert len(segments) == 3 == len(calls)
    assert " ".join(s["text"] for s in segments) == LONG_TURN  # the instruction is never reported as spoken
    assert all(text == s["text"] for (text, _), s in zip(calls, segments, strict=True))
    return calls, segments


async def test_turn_speaks_its_first_segment_with_the_instruction_and_continues_from_it(port, engine):
    calls, _ = await _turn(port, engine, {"instruction": STYLE})
    assert calls[0][1]["instruction"] == STYLE and "prompt_latents" not in calls[0][1]
    for (before, _), (_, kw) in zip(calls, calls[1:], strict=False):
        assert "instruction" not in kw and kw["prompt_text"] == before  # the designed voice's own audio leads on


async def test_without_continuation_every_segment_carries_the_instruction(port, engine):
    calls, _ = await _turn(port, engine, {"instruction": STYLE, "continuation": False})
    assert all(kw["instruction"] == STYLE and "prompt_latents" not in kw for _, kw in calls)


async def test_bad_instructions_are_invalid_values(port):
    async with await VoxgateClient.connect(f"ws://127.0.0.1:{port}/v1/stream", api_key=KEY) as c:
        for bad in ("x" * (MAX_INSTRUCTION_CHARS + 1), 5):
            with pytest.raises(ServerError) as e:
                await c.start(generation={"instruction": bad})
            assert e.value.code == "invalid_value"


async def test_openai_instructions_are_the_instruction(port, engine):
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0)
    with recorded_calls(engine) as calls:
        response = await client.audio.speech.create(model="gpt-4o-mini-tts", voice="alloy", input=TEXT,
                                                    instructions=STYLE, response_format="pcm",
                                                    extra_body={"generation": {"seed": SEED, "max_length": 3}})
    assert len(response.content) > 0
    assert " ".join(text for text, _ in calls) == TEXT
    assert calls[0][1]["instruction"] == STYLE and all("instruction" not in kw for _, kw in calls[1:])
    with pytest.raises(openai.BadRequestError) as e:
        await client.audio.speech.create(model="tts-1", voice="alloy", input=TEXT,
                                         instructions="y" * (MAX_INSTRUCTION_CHARS + 1))
    assert e.value.body["param"] == "instructions"


async def test_a_voice_designed_from_a_description_is_stored_for_its_key(engine):
    from gateway.auth import Auth
    from gateway.server import ServerConfig, create_app, start_server

    other = "sk-other"
    runner, port = await start_server(create_app(engine, ServerConfig(web_client_dir=None),
                                                 auth=Auth({KEY: [], other: []})))
    url = f"http://127.0.0.1:{port}/v1/voices"
    try:
        async with aiohttp.ClientSession() as http:
            body = {"description": STYLE, "text": "A short sample.", "seed": SEED}
            async with http.post(url, json=body, headers=_bearer(KEY)) as r:
                assert r.status == 201, await r.text()
                made = await r.json()
            assert made["mode"] == "reference" and made["description"] == STYLE and not made["public"]
            # the voice is the sample the instruction made: its latents, as the engine speaks them
            sample = [c.latents async for c in engine.generate("A short sample.", instruction=STYLE, seed=SEED)]
            assert np.allclose(engine.voice_latents(made["voice_id"]), np.stack(sample), atol=1e-5)
            async with http.get(url, headers=_bearer(KEY)) as r:
                assert made in (await r.json())["voices"]
            async with http.get(url, headers=_bearer(other)) as r:  # the key that made it owns it
                assert made["voice_id"] not in {v["voice_id"] for v in (await r.json())["voices"]}
            for bad in ({}, {"description": ""}, {"description": STYLE, "speed": 2}, {"description": STYLE, "seed": -1},
                        {"description": "z" * (MAX_INSTRUCTION_CHARS + 1)}, [STYLE]):
                async with http.post(url, json=bad, headers=_bearer(KEY)) as r:
                    assert r.status == 400 and (await r.json())["error"]["code"] == "invalid_value", bad
            json_type = {**_bearer(KEY), "Content-Type": "application/json"}
            async with http.post(url, data=b"{not json", headers=json_type) as r:
                assert r.status == 400
        async with await VoxgateClient.connect(f"ws://127.0.0.1:{port}/v1/stream", api_key=KEY) as c:
            await c.start(voice=made["voice_id"], output={"format": "pcm_s16le"},
                          generation={"seed": SEED, "max_length": 3})
            assert (await c.speak("Spoken with the designed voice.", "t")).done["audio_ms"] > 0
    finally:
        await runner.cleanup()
    await engine.remove_voice(made["voice_id"])


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_cartesia_emotion_is_the_instruction(port, engine):
    import json

    import websockets

    request = {"model_id": "sonic-3", "voice": {"mode": "id", "id": "any"}, "context_id": "c", "transcript": "Hi.",
               "output_format": {"container": "raw", "encoding": "pcm_s16le", "sample_rate": 24000},
               "generation_config": {"emotion": ["excited", "curious"]}}
    with recorded_calls(engine) as calls:
        async with websockets.connect(f"ws://127.0.0.1:{port}/tts/websocket?api_key={KEY}") as ws:
            await ws.send(json.dumps(request))
            while (m := json.loads(await ws.recv()))["type"] != "done":
                assert m["type"] != "error", m
            await ws.send(json.dumps({**request, "context_id": "d", "generation_config": {"emotion": 3}}))
            m = json.loads(await ws.recv())
            assert m["type"] == "error" and "emotion" in m["message"]
        body = {k: v for k, v in request.items() if k != "context_id"}
        async with aiohttp.ClientSession() as http, http.post(f"http://127.0.0.1:{port}/tts/bytes", json=body,
                                                              headers={"X-API-Key": KEY}) as r:
            assert r.status == 200 and len(await r.read()) > 0
    assert [(text, kw.get("instruction")) for text, kw in calls] == [("Hi.", "excited, curious")] * 2


async def test_a_reference_voice_with_a_transcript_takes_an_instruction_without_its_own_prompt(engine):
    t = np.arange(6000) / 16000
    buf = io.BytesIO()
    sf.write(buf, (0.2 * np.sin(2 * np.pi * 170 * t)).astype(np.float32), 16000, format="WAV")
    voice = await engine.add_voice(audio=buf.getvalue(), text="Its transcript.", voice_id="ref-with-text")
    try:
        own = engine.generate(TEXT, voice=voice, seed=SEED, max_length=2)
        styled = engine.generate(TEXT, voice=voice, instruction=STYLE, seed=SEED, max_length=2)
        for gen in (own, styled):
            assert [c async for c in gen]
        assert styled._spec.token_ids[-1] == 101  # reference + (instruction)text, no prompt audio after it
        assert own._spec.token_ids[-1] == 0  # its own prompt's audio ends the prompt
    finally:
        await engine.remove_voice(voice)
