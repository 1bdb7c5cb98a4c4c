"""For the compat endpoints' tests: Pipecat, the voice-agent framework, as a real third-party client (one TTS
service in a pipeline, fed frames, with every frame it pushes collected), and the check that a client gone
mid-speech leaves nothing behind."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import aiohttp

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
