"""For the compat endpoints' tests: Pipecat and LiveKit Agents, the voice-agent frameworks, as real third-party
clients (a Pipecat TTS service in a pipeline, fed frames, with every frame it pushes collected; a LiveKit TTS plugin
driven through `synthesize()` and `stream()`), the official SDKs' message models as the judge of every message a
compat socket sends, and the check that a client gone mid-speech leaves nothing behind."""

from __future__ import annotations

import asyncio
import contextlib
import types
import typing
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pydantic

from gateway.auth import Auth
from gateway.server import ServerConfig, create_app, start_server


@contextlib.asynccontextmanager
async def compat_server(engine, key: str | None = None) -> AsyncIterator[int]:
    """A real gateway with the compat endpoints on, over `engine`, accepting API key `key` (None: no auth): its
    port."""
    auth = Auth({key}) if key is not None else None
    runner, port = await start_server(create_app(engine, ServerConfig(web_client_dir=None), auth=auth, compat=True))
    try:
        yield port
    finally:
        await runner.cleanup()


async def run_tts(tts, inputs: list, sample_rate: int, until: Callable[[list], bool] | None = None) -> list:
    """Queue `inputs` into a pipeline of `tts` alone, wait for its TTSStoppedFrame (or an ErrorFrame) and, if given,
    for `until(frames)` (frames paced to playback, such as word-timed text, keep coming after it; at most 30 s), end
    it; the frames the service pushed."""
    from pipecat.frames.frames import EndFrame, ErrorFrame, TTSStoppedFrame
    from pipecat.pipeline.pipeline import Pipeline
    from pipecat.pipeline.task import PipelineParams
    from pipecat.pipeline.worker import PipelineWorker
    from pipecat.processors.frame_processor import FrameProcessor
    from pipecat.workers.runner import WorkerRunner

    frames = []
    stopped = asyncio.Event()

    class Collect(FrameProcessor):
        async def process_frame(self, frame, direction):
            await super().process_frame(frame, direction)
            frames.append(frame)
            if isinstance(frame, TTSStoppedFrame | ErrorFrame):
                stopped.set()
            await self.push_frame(frame, direction)

    worker = PipelineWorker(Pipeline([tts, Collect()]), params=PipelineParams(audio_out_sample_rate=sample_rate))
    runner = WorkerRunner(handle_sigint=False)
    await runner.add_workers(worker)
    run = asyncio.create_task(runner.run())
    for frame in inputs:
        await worker.queue_frame(frame)
    await asyncio.wait_for(stopped.wait(), 30)
    for _ in range(300):
        if until is None or until(frames):
            break
        await asyncio.sleep(0.1)
    await worker.queue_frame(EndFrame())
    await asyncio.wait_for(run, 30)
    return frames


def spoken_audio(frames: list, sample_rate: int) -> list:
    """The TTSAudioRawFrames of a service's utterance, once the frames are checked as any Pipecat TTS service must
    push them: no ErrorFrame, mono audio at `sample_rate`, after a TTSStartedFrame and before a TTSStoppedFrame."""
    from pipecat.frames.frames import ErrorFrame, TTSAudioRawFrame, TTSStartedFrame, TTSStoppedFrame

    assert not [f for f in frames if isinstance(f, ErrorFrame)]
    audio = [f for f in frames if isinstance(f, TTSAudioRawFrame)]
    assert audio and all(f.sample_rate == sample_rate and f.num_channels == 1 for f in audio)
    kinds = [type(f) for f in frames]
    assert kinds.index(TTSStartedFrame) < kinds.index(TTSAudioRawFrame) < kinds.index(TTSStoppedFrame)
    return audio


def words_spoken(frames: list) -> list[str]:
    """The words of the TTSTextFrames a service pushed (its transcript of what was spoken, from our timestamps)."""
    from pipecat.frames.frames import TTSTextFrame

    return " ".join(f.text for f in frames if isinstance(f, TTSTextFrame)).split()


async def livekit_synthesize(tts, text: str) -> list:
    """The SynthesizedAudio events of a LiveKit TTS plugin's `synthesize(text)` (one request, one text)."""
    async with tts.synthesize(text) as stream:
        return [event async for event in stream]


async def livekit_stream(tts, tokens: list[str]) -> list:
    """The SynthesizedAudio events of a LiveKit TTS plugin's `stream()`, fed as an agent feeds it one reply: its
    tokens pushed one by one, a flush, end_input (a stream is one segment: LiveKit makes a new one per reply)."""
    stream = tts.stream()
    try:
        for token in tokens:
            stream.push_text(token)
        stream.flush()
        stream.end_input()
        return [event async for event in stream]
    finally:
        await stream.aclose()


def livekit_audio(events: list, sample_rate: int):
    """The events' audio as float samples, once checked as LiveKit plays it: mono frames at `sample_rate`, one
    request, audible (not silence)."""
    import numpy as np

    frames = [e.frame for e in events]
    assert frames and all(f.sample_rate == sample_rate and f.num_channels == 1 for f in frames)
    assert len({e.request_id for e in events}) == 1 and events[-1].is_final
    samples = np.concatenate([np.frombuffer(f.data, dtype=np.int16) for f in frames]).astype(np.float32) / 32768.0
    assert np.sqrt(np.mean(samples ** 2)) > 1e-4
    return samples


def livekit_transcript(events: list) -> list:
    """The aligned transcript a LiveKit TTS plugin attached to its audio frames (TimedStrings, in order)."""
    from livekit.agents.types import USERDATA_TIMED_TRANSCRIPT

    return [t for e in events for t in e.frame.userdata.get(USERDATA_TIMED_TRANSCRIPT, [])]


def llm_turn(*tokens: str) -> list:
    """The frames an LLM service pushes for one reply of these tokens."""
    from pipecat.frames.frames import LLMFullResponseEndFrame, LLMFullResponseStartFrame, LLMTextFrame

    return [LLMFullResponseStartFrame(), *(LLMTextFrame(t) for t in tokens), LLMFullResponseEndFrame()]


async def released(port: int, engine) -> None:
    """Wait until the server holds no session and the engine no request (a client has gone); fail after ~5 s."""
    async with aiohttp.ClientSession() as http:
        for _ in range(100):
            async with http.get(f"http://127.0.0.1:{port}/readyz") as r:
                sessions = (await r.json())["sessions"]
            if sessions == 0 and engine.stats().in_flight == 0:
                return
            await asyncio.sleep(0.05)
    raise AssertionError(f"{sessions} sessions and {engine.stats().in_flight} engine requests outlived the client")


def conforms(model: type[pydantic.BaseModel], message: dict[str, Any]) -> pydantic.BaseModel:
    """`message` parsed by an official SDK's own pydantic model, strictly: no value coerced into its type, and no
    field the model does not declare, at any depth (the SDKs allow extra fields; a faithful peer sends none)."""
    parsed = model.model_validate(message, strict=True)
    _declared_only(model, message, model.__name__)
    return parsed


def _declared_only(model: type[pydantic.BaseModel], message: dict[str, Any], where: str) -> None:
    fields = {(f.alias or name): f for name, f in model.model_fields.items()}
    unknown = set(message) - set(fields)
    assert not unknown, f"{where}: fields the SDK does not declare: {sorted(unknown)}"
    for key, value in message.items():
        nested = [t for t in _types_in(fields[key].annotation) if isinstance(t, type)
                  and issubclass(t, pydantic.BaseModel)]
        if nested and isinstance(value, dict):
            _declared_only(nested[0], value, f"{where}.{key}")


def _types_in(annotation: Any) -> list[Any]:
    """The types inside Optional[...], Annotated[...], unions."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType, typing.Annotated):
        return [t for arg in typing.get_args(annotation) for t in _types_in(arg)]
    return [annotation]


def elevenlabs_message(message: dict[str, Any], multi: bool) -> pydantic.BaseModel:
    """A stream-input (`multi` False) or multi-stream-input message checked against the `elevenlabs` SDK's models:
    AudioOutput(Multi) or FinalOutput(Multi)."""
    from elevenlabs.types import AudioOutput, AudioOutputMulti, FinalOutput, FinalOutputMulti

    final = "isFinal" in message
    model = (FinalOutputMulti if final else AudioOutputMulti) if multi else (FinalOutput if final else AudioOutput)
    return conforms(model, message)


def cartesia_message(message: dict[str, Any]) -> pydantic.BaseModel:
    """A `/tts/websocket` message checked against the `cartesia` SDK's WebsocketResponse model of its type."""
    from cartesia.types import websocket_response as w

    models = {"chunk": w.Chunk, "flush_done": w.FlushDone, "done": w.Done, "timestamps": w.Timestamps,
              "error": w.Error, "phoneme_timestamps": w.PhonemeTimestamps}
    return conforms(models[message["type"]], message)


def deepgram_message(message: dict[str, Any]) -> pydantic.BaseModel:
    """A `/v1/speak` control message checked against the `deepgram-sdk` speak v1 model of its type."""
    from deepgram.speak.v1.types import SpeakV1Cleared, SpeakV1Flushed, SpeakV1Metadata, SpeakV1Warning

    models = {"Metadata": SpeakV1Metadata, "Flushed": SpeakV1Flushed, "Cleared": SpeakV1Cleared,
              "Warning": SpeakV1Warning}
    return conforms(models[message["type"]], message)
