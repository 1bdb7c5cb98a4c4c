"""The browser client and demo page in real headless Chromium, against a real gateway running the tiny demo engine.

Run with `pytest -m browser`. The reference for what the page decoded is the server's own Opus packets, taken off
the WebSocket and decoded here with libopus (opuslib)."""

from __future__ import annotations

import os
import struct
import time

import numpy as np
import opuslib
import pytest
import soundfile
from browser_support import OPUS_LOOKAHEAD, ROOT, GatewayProcess, distinct_colours, launch_chromium, page_pcm
from playwright import sync_api

pytestmark = [pytest.mark.browser, pytest.mark.timeout(240)]


FRAME_HEADER = struct.Struct("!BBBBHII")  # magic, version, kind, flags, index, seq, pts_ms (docs/PROTOCOL.md)
OPUS, PCM_S16LE = 1, 2


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    log = tmp_path_factory.mktemp("gateway") / "gateway.log"
    gw = GatewayProcess(log_path=log)
    gw.start()
    yield gw
    gw.stop()


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as playwright:
        chromium = launch_chromium(playwright)
        yield chromium
        chromium.close()


class Demo:
    """The demo page (in test mode) plus every binary frame it received and every error it logged."""

    def __init__(self, browser, gateway, *, without_webcodecs: bool = False, viewport: dict | None = None):
        self.context = browser.new_context(viewport=viewport or {"width": 1100, "height": 900})
        if without_webcodecs:
            self.context.add_init_script("delete window.AudioDecoder;")
        self.page = self.context.new_page()
        self.frames: list[bytes] = []
        self.page_errors: list[str] = []
        self.page.on("pageerror", lambda e: self.page_errors.append(str(e)))
        self.page.on("websocket", lambda ws: ws.on(
            "framereceived", lambda data: self.frames.append(data) if isinstance(data, bytes) else None))
        self.page.goto(gateway.url + "/?test")
        self.wait("() => window.__voxgateTest?.client.state === 'open'")

    def wait(self, expression: str, arg=None, timeout_s: float = 60) -> object:
        return self.page.wait_for_function(expression, arg=arg, timeout=timeout_s * 1000).json_value()

    def event(self, kind: str, timeout_s: float = 60) -> dict:
        """The detail of the first event of this kind (waits for it)."""
        return self.wait("(k) => window.__voxgateTest.events.find((e) => e.type === k)?.detail", kind, timeout_s)

    def events(self, kind: str) -> list[dict]:
        return self.page.evaluate("(k) => window.__voxgateTest.events.filter((e) => e.type === k)"
                                  ".map((e) => e.detail)", kind)

    def stats(self) -> dict:
        return self.page.evaluate("() => window.__voxgateTest.stats()")

    def say(self, text: str, button: str = "#speak") -> None:
        self.page.fill("#text", text)
        self.page.click(button)

    def packets(self, index: int) -> list[tuple[int, bytes]]:
        """(kind, payload) of a turn's frames, checked to be one gapless sequence."""
        frames = [(FRAME_HEADER.unpack_from(f), f[FRAME_HEADER.size:]) for f in self.frames]
        mine = [(h, payload) for h, payload in frames if h[4] == index]
        assert [h[5] for h, _ in mine] == list(range(len(mine))), "frames of the turn are not seq 0..n-1"
        assert all(h[0] == 0x56 and h[1] == 1 for h, _ in mine)
        return [(h[2], payload) for h, payload in mine]

    def close(self) -> None:
        self.context.close()


def opus_reference(packets: list[tuple[int, bytes]]) -> np.ndarray:
    decoder = opuslib.Decoder(48000, 1)
    assert all(kind == OPUS for kind, _ in packets)
    return np.concatenate([np.frombuffer(decoder.decode_float(p, 5760), dtype=np.float32) for _, p in packets])


def test_streamed_text_plays_the_servers_opus_audio(browser, gateway, tmp_path):
    demo = Demo(browser, gateway)
    try:
        assert demo.page.is_visible("#demo-banner"), "the page must say that the tiny demo model is running"
        assert "Opus" in demo.page.inner_text("#status")
        demo.page.fill("#rate", "20")
        demo.say("Streaming speech, one word at a time, like a language model.", button="#stream")
        done = demo.event("turn.finished")  # context.done arrived and the decoder has drained
        assert done["status"] == "done"
        started = demo.event("context.started")
        assert started["context_id"] == done["context_id"]

        heard = page_pcm(demo.page, done["context_id"])
        reference = opus_reference(demo.packets(started["index"]))
        assert len(heard) == len(reference) == round(done["audio_ms"] * 48)
        assert np.sqrt(np.mean(reference[OPUS_LOOKAHEAD:] ** 2)) > 1e-3, "the turn is silent: nothing to compare"
        np.testing.assert_allclose(heard, reference, atol=2e-3)  # WebCodecs and libopus: the same decoder

        # Taken while the turn's tail is still playing, so the waveform and readouts are live.
        shot = tmp_path / "demo.png"
        png = demo.page.screenshot(path=str(shot), full_page=True)
        if os.environ.get("VOXGATE_UPDATE_SCREENSHOT"):  # refresh the README's picture on request, not every run
            (ROOT / "docs" / "demo.png").write_bytes(png)
        print(f"\ndemo page screenshot: {shot}")
        assert distinct_colours(demo.page, png) > 100, "the screenshot looks blank"

        # The player plays every sample after the lookahead, and reports it.
        demo.wait("() => window.__voxgateTest.events.some((e) => e.type === 'idle')")
        played_ms = demo.stats()["playedMs"][done["context_id"]]
        assert played_ms == pytest.approx((len(heard) - OPUS_LOOKAHEAD) / 48, abs=0.5)
        assert demo.page.inner_text("#ttfb").endswith("ms")
        assert demo.page_errors == []

    finally:
        demo.close()


# What the player's first cushion (MIN_CUSHION_MS in player-worklet.js) leaves the page to receive and decode in.
CLIENT_SLACK_MS = 60


def server_came_close_to_a_gap(metrics: dict, patch_ms: float) -> bool:
    """Whether, by the server's own `context.done` metrics, the engine came within CLIENT_SLACK_MS of starving the
    listener: a silence it caused, a later segment whose first audio took nearly all the audio queued when it was
    submitted, or a wait for a chunk that left less than the slack of a patch (on a loaded 2-core machine the tiny
    engine's steps slow down ten-fold, and the page then runs dry through no fault of its own)."""
    log = metrics["segment_log"]
    return (metrics["max_gap_ms"] > 0
            or any(s["engine_ttfb_ms"] > s["lead_ms"] - CLIENT_SLACK_MS for s in log[1:])
            or any(s["max_wait_ms"] > patch_ms - CLIENT_SLACK_MS for s in log))


def test_steady_stream_has_no_underrun_after_the_cushion(browser, gateway):
    """The page never runs dry while the server keeps ahead; where the machine was too slow for that, every
    underrun is reported, raises the cushion, and still no sample is lost."""
    demo = Demo(browser, gateway)
    try:
        patch_ms = demo.event("open")["model"]["patch_ms"]
        demo.say("A steady stream of speech. It keeps on going without a pause, sentence after sentence.")
        done = demo.event("turn.finished")
        demo.wait("() => window.__voxgateTest.events.some((e) => e.type === 'idle')")
        stats = demo.stats()
        underruns = demo.events("underrun")
        assert stats["playedMs"][done["context_id"]] == pytest.approx(
            done["audio_ms"] - OPUS_LOOKAHEAD / 48, abs=0.5), "the player lost or repeated audio"
        assert len(done["metrics"]["segment_log"]) > 1, "one segment: no join between segments was heard"
        if not server_came_close_to_a_gap(done["metrics"], patch_ms):
            assert stats["underruns"] == 0, f"underruns while the server kept ahead: {underruns}, {done['metrics']}"
        print(f"\nunderruns {stats['underruns']}, server metrics {done['metrics']}")
        assert [u["underruns"] for u in underruns] == list(range(1, stats["underruns"] + 1))
        assert stats["cushionMs"] == min(400, 60 + 40 * stats["underruns"]), "each underrun raises the cushion"
        assert all(u["context"] == done["context_id"] for u in underruns)
    finally:
        demo.close()


def test_barge_in_silences_at_once_and_the_server_agrees(browser, gateway):
    demo = Demo(browser, gateway)
    try:
        demo.say("This is a long answer that the listener will interrupt. " * 6)
        started = demo.event("context.started")
        cid = started["context_id"]
        demo.wait("(id) => (window.__voxgateTest.client.playerStats.playedMs[id] ?? 0) > 300", cid)
        # Click, then ask the player: silent by its very next message, within a few milliseconds.
        elapsed_ms, after = demo.page.evaluate("""async () => {
            const t0 = performance.now();
            document.querySelector("#cancel").click();
            const stats = await window.__voxgateTest.stats();
            return [performance.now() - t0, stats];
        }""")
        assert after["bufferedMs"] == 0 and not after["playing"]
        assert elapsed_ms < 100
        cancelled = demo.event("context.cancelled", timeout_s=10)
        played = after["playedMs"][cid]
        time.sleep(0.3)
        assert demo.stats()["playedMs"][cid] == played, "audio kept playing after the barge-in"
        assert cancelled["context_id"] == cid
        assert cancelled["played_source"] == "client"
        assert cancelled["audio_played_ms"] == pytest.approx(played, abs=40)
        assert cancelled["audio_sent_ms"] > cancelled["audio_played_ms"], "nothing was queued: cancel proved nothing"
        assert demo.events("context.done") == []
    finally:
        demo.close()


def test_pcm_fallback_without_webcodecs_on_a_phone_screen(browser, gateway):
    demo = Demo(browser, gateway, without_webcodecs=True, viewport={"width": 390, "height": 844})
    try:
        assert demo.page.evaluate("() => window.__voxgateTest.client.outputFormat") == "pcm_s16le"
        assert "no WebCodecs" in demo.page.inner_text("#status")
        assert demo.event("open")["output"]["format"] == "pcm_s16le"
        demo.say("No WebCodecs here, so the server sends PCM.")
        done = demo.event("turn.finished")
        started = demo.event("context.started")
        packets = demo.packets(started["index"])
        assert {kind for kind, _ in packets} == {PCM_S16LE}
        reference = np.concatenate([np.frombuffer(p, dtype="<i2") for _, p in packets]).astype(np.float32) / 32768
        np.testing.assert_array_equal(page_pcm(demo.page, done["context_id"]), reference)

        # Phone-sized: nothing wider than the screen, and every control has a label.
        assert demo.page.evaluate("() => document.documentElement.scrollWidth <= window.innerWidth")
        unlabelled = demo.page.evaluate("() => [...document.querySelectorAll('input, select, textarea')]"
                                        ".filter((el) => el.labels.length === 0).map((el) => el.id)")
        assert unlabelled == []
        assert demo.page_errors == []
    finally:
        demo.close()


def test_player_is_gapless_across_turns_and_counts_a_real_underrun(browser, gateway):
    demo = Demo(browser, gateway)
    try:
        # Feed the page's own player directly and record what it outputs.
        result = demo.page.evaluate("""async () => {
            const client = window.__voxgateTest.client;
            const ctx = client.audioContext, port = client.player.port;
            const source = `registerProcessor("recorder", class extends AudioWorkletProcessor {
                process(inputs) { if (inputs[0][0]) this.port.postMessage(inputs[0][0].slice()); return true; }
            });`;
            await ctx.audioWorklet.addModule(URL.createObjectURL(new Blob([source], {type: "text/javascript"})));
            const recorder = new AudioWorkletNode(ctx, "recorder");
            const recorded = [];
            recorder.port.onmessage = (e) => recorded.push(e.data);
            client.outputNode.connect(recorder);
            recorder.connect(ctx.destination);
            const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
            const push = (context, value, n) =>
                port.postMessage({type: "push", context, samples: new Float32Array(n).fill(value)});
            push("A", 0.5, 14400); port.postMessage({type: "end", context: "A"});
            push("B", 0.25, 14400); port.postMessage({type: "end", context: "B"});
            await sleep(900);
            const gapless = await window.__voxgateTest.stats();
            push("C", 0.125, 4800);  // 100 ms, then nothing for a while: the listener hears a gap mid-turn
            await sleep(400);
            push("C", 0.125, 4800); port.postMessage({type: "end", context: "C"});
            await sleep(400);
            const after = await window.__voxgateTest.stats();
            await sleep(50);  // the recorder's last messages
            recorder.disconnect();
            const all = new Float32Array(recorded.reduce((n, c) => n + c.length, 0));
            let o = 0;
            for (const c of recorded) { all.set(c, o); o += c.length; }
            return {gapless, after, samples: Array.from(all.filter((x) => x > 0.2))};
        }""")
        heard = np.array(result["samples"], dtype=np.float32)
        # A's samples then B's, none dropped, no silence between the two turns.
        assert np.count_nonzero(np.isclose(heard, 0.5)) == 14400
        assert np.count_nonzero(np.isclose(heard, 0.25)) == 14400
        assert result["gapless"]["underruns"] == 0
        assert result["gapless"]["playedMs"] == {"A": 300, "B": 300}
        assert result["after"]["underruns"] == 1
        assert result["after"]["cushionMs"] > result["gapless"]["cushionMs"], "the cushion grows after an underrun"
        assert result["after"]["playedMs"]["C"] == 200
    finally:
        demo.close()


def test_uploaded_voice_is_listed_chosen_and_spoken(browser, gateway, tmp_path):
    wav = tmp_path / "reference.wav"
    t = np.arange(16000) / 16000
    soundfile.write(wav, (0.3 * np.sin(2 * np.pi * 180 * t) * (1 + np.sin(2 * np.pi * 3 * t))).astype(np.float32),
                    16000)
    demo = Demo(browser, gateway)
    try:
        demo.page.set_input_files("#voice-file", str(wav))
        demo.page.fill("#voice-text", "A reference recording.")
        demo.page.click("#upload button[type=submit]")
        voice_id = demo.wait("() => document.querySelector('#voice').value || null")
        assert voice_id in demo.page.evaluate("() => [...document.querySelector('#voice').options].map((o) => o.value)")
        listed = demo.page.evaluate("async () => (await (await fetch('/v1/voices')).json()).voices")
        assert voice_id in [v["voice_id"] for v in listed]
        demo.wait("() => window.__voxgateTest.events.some((e) => e.type === 'session.updated')")
        demo.say("Now in the uploaded voice.")
        assert demo.event("turn.finished")["audio_ms"] > 0
        assert demo.events("error") == []
    finally:
        demo.close()


def test_reconnects_after_a_server_restart(browser, gateway):
    demo = Demo(browser, gateway)
    try:
        gateway.stop()
        assert demo.event("reconnecting", timeout_s=20)["attempt"] >= 1
        gateway.start()
        demo.event("reconnected", timeout_s=30)
        assert "Connected" in demo.page.inner_text("#status")
        demo.say("Back again after the restart.")
        done = demo.event("turn.finished")
        assert len(page_pcm(demo.page, done["context_id"])) > 0
    finally:
        demo.close()


@pytest.mark.parametrize("response_format", ["wav", "flac", "mp3", "aac", "opus"])
def test_every_speech_container_decodes_in_the_browser(browser, gateway, response_format):
    """What POST /v1/audio/speech streams, as a page fetches it, decodes with Web Audio (docs/INTEGRATIONS.md)."""
    page = browser.new_page()
    try:
        page.goto(gateway.url + "/")
        seconds = page.evaluate("""async (format) => {
            const r = await fetch("/v1/audio/speech", {method: "POST", headers: {"content-type": "application/json"},
                body: JSON.stringify({model: "tts-1", voice: "alloy", input: "Hello there.", response_format: format,
                                      generation: {seed: 1, max_length: 4}})});
            if (!r.ok) return `HTTP ${r.status}: ${await r.text()}`;
            const audio = await new OfflineAudioContext(1, 1, 48000).decodeAudioData(await r.arrayBuffer());
            return audio.duration;
        }""", response_format)
    finally:
        page.close()
    assert isinstance(seconds, float), seconds
    assert abs(seconds - 0.64) < 0.1, f"{response_format}: {seconds:.3f} s"  # 4 patches of 160 ms, give or take padding


def test_style_field_and_designed_voice(browser, gateway):
    demo = Demo(browser, gateway)
    try:
        demo.page.fill("#style", "warm and slow")
        demo.page.dispatch_event("#style", "change")
        updated = demo.event("session.updated")
        assert updated["generation"]["instruction"] == "warm and slow"
        demo.page.fill("#design-description", "A calm, deep voice")
        demo.page.fill("#design-text", "A short sample.")
        demo.page.click("#design button[type=submit]")
        voice_id = demo.wait("() => document.querySelector('#voice').value || null")
        listed = demo.page.evaluate("async () => (await (await fetch('/v1/voices')).json()).voices")
        assert {"voice_id": voice_id, "description": "A calm, deep voice"}.items() <= \
            next(v for v in listed if v["voice_id"] == voice_id).items()
        demo.wait("(id) => window.__voxgateTest.events.some((e) => e.type === 'session.updated' "
                  "&& e.detail.voice === id)", voice_id)
        demo.say("Spoken in the designed voice, in the chosen style.")
        assert demo.event("turn.finished")["audio_ms"] > 0
        assert demo.events("error") == [] and demo.page_errors == []
        spoken = " ".join(e["text"] for e in demo.events("segment.started"))
        assert "warm" not in spoken  # the instruction is never reported as spoken
    finally:
        demo.close()
