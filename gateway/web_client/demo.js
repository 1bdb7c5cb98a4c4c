// The demo page: wires the controls of index.html to a VoxgateClient. Add ?test to the URL to expose
// window.__voxgateTest (decoded PCM per turn, player stats, events) for the browser tests.

import { VoxgateClient, canDecodeOpus } from "./voxgate.js";

const $ = (id) => document.getElementById(id);
const params = new URLSearchParams(location.search);
const testMode = params.has("test");
const streamUrl = new URL("/v1/stream", location.href);
streamUrl.protocol = location.protocol === "https:" ? "wss:" : "ws:";

const events = [];
let client = null;
let streaming = null; // the running "stream it like an LLM" timer

function log(text) {
  const item = document.createElement("li");
  item.textContent = `${new Date().toLocaleTimeString()}  ${text}`;
  $("log").prepend(item);
  while ($("log").children.length > 50) $("log").lastChild.remove();
}

function setStatus(text, ok = false) {
  $("status").textContent = text;
  $("status").classList.toggle("ok", ok);
}

function chosenStyle() {
  return $("style").value.trim() || null;
}

function chosenOutput() {
  return { format: $("format").value };
}

async function start() {
  if (!canDecodeOpus()) {
    $("format").value = "pcm_s16le";
    $("format").querySelector('option[value="opus"]').disabled = true;
  }
  client = new VoxgateClient(streamUrl.href, {
    token: params.get("token") ?? undefined,
    voice: $("voice").value || null,
    output: chosenOutput(),
    generation: { instruction: chosenStyle() },
    capture: testMode,
  });
  watch(client);
  if (testMode) exposeTestHook(client);
  try {
    await client.open();
  } catch (error) {
    setStatus(`Could not connect: ${error.message}`);
    return;
  }
  drawMeter(client);
  loadVoices();
}

function watch(c) {
  const note = (type, detail) => events.push({ type, detail, at: performance.now() });
  for (const type of ["open", "reconnecting", "reconnected", "close", "context.started", "segment.started",
    "context.done", "context.cancelled", "text.flushed", "session.updated", "turn.finished", "error", "underrun", "first-audio", "idle"]) {
    c.addEventListener(type, (e) => note(type, e.detail));
  }
  c.addEventListener("session", (e) => {
    const model = e.detail.model ?? {};
    const format = c.outputFormat === "opus" ? "Opus" : "PCM";
    const name = (model.name ?? "model").split("/").filter(Boolean).pop(); // a local path or a hub id
    setStatus(`Connected: ${name} · ${format}${canDecodeOpus() ? "" : " (no WebCodecs here)"}`, true);
    $("demo-banner").hidden = !(model.demo ?? model.tiny ?? false);
  });
  c.addEventListener("reconnecting", (e) => setStatus(`Connection lost; retrying (attempt ${e.detail.attempt})…`));
  c.addEventListener("close", () => setStatus("Disconnected."));
  c.addEventListener("segment.started", (e) => log(`segment ${e.detail.segment}: “${e.detail.text}”`));
  c.addEventListener("context.done", (e) => {
    const m = e.detail.metrics ?? {};
    log(`done: ${Math.round(e.detail.audio_ms)} ms of audio, server TTFB ${fmtMs(m.ttfb_ms)}`);
  });
  c.addEventListener("context.cancelled", (e) =>
    log(`cancelled after ${Math.round(e.detail.audio_played_ms)} ms heard; unspoken: “${e.detail.text_remaining}”`));
  c.addEventListener("error", (e) => log(`error ${e.detail.code}: ${e.detail.message}`));
  c.addEventListener("underrun", () => log("underrun: the player ran dry, cushion raised"));
  c.addEventListener("metrics", (e) => showMetrics(e.detail));
}

function fmtMs(ms) {
  return ms === null || ms === undefined ? "–" : `${Math.round(ms)} ms`;
}

function showMetrics(m) {
  $("ttfb").textContent = fmtMs(m.ttfbMs);
  $("buffered").textContent = fmtMs(m.bufferedMs);
  $("underruns").textContent = String(m.underruns ?? 0);
  $("bitrate").textContent = `${m.bitrateKbps.toFixed(1)} kbps`;
}

function guarded(action) {
  return async () => {
    try {
      await action();
    } catch (error) {
      log(`${error.code ?? "error"}: ${error.message}`);
    }
  };
}

function stopStreaming() {
  clearInterval(streaming);
  streaming = null;
}

async function speak() {
  stopStreaming();
  const text = $("text").value.trim();
  if (!text) return log("nothing to say: the text box is empty");
  client.append(text);
  await client.end();
}

// Sends the text a word at a time, the way an LLM's tokens arrive.
function streamLikeLlm() {
  stopStreaming();
  const words = $("text").value.trim().split(/(?<=\s)/);
  if (!words[0]) return log("nothing to say: the text box is empty");
  const context = client.append(words.shift());
  const perSecond = Number($("rate").value);
  streaming = setInterval(guarded(async () => {
    if (words.length === 0) {
      stopStreaming();
      await client.end({ context });
      return;
    }
    client.append(words.shift(), { context });
  }), 1000 / perSecond);
}

async function bargeIn() {
  stopStreaming();
  await client.cancel();
}

async function loadVoices() {
  try {
    const response = await fetch("/v1/voices");
    if (!response.ok) return;
    const body = await response.json();
    const voices = Array.isArray(body) ? body : body.voices ?? [];
    const select = $("voice");
    for (const voice of voices) {
      const id = typeof voice === "string" ? voice : voice.id ?? voice.voice_id ?? voice.name;
      if (!id || [...select.options].some((o) => o.value === id)) continue;
      const name = voice.name ?? voice.description;
      select.add(new Option(name && name !== id ? `${name} (${id})` : id, id));
    }
  } catch {
    // the list is a convenience; the default voice always works
  }
}

async function uploadVoice(event) {
  event.preventDefault();
  const form = new FormData($("upload"));
  if (!form.get("text")) form.delete("text");
  const response = await fetch("/v1/voices", { method: "POST", body: form });
  const body = await response.json().catch(() => ({}));
  if (!response.ok) {
    log(`upload failed: ${body.error?.message ?? body.message ?? response.statusText}`);
    return;
  }
  const id = body.voice_id;
  log(`voice stored: ${id}`);
  await loadVoices();
  $("voice").value = id;
  client.update({ voice: id });
}

async function designVoice(event) {
  event.preventDefault();
  const body = { description: $("design-description").value.trim() };
  if ($("design-text").value.trim()) body.text = $("design-text").value.trim();
  log("designing a voice…");
  const response = await fetch("/v1/voices", {
    method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
  });
  const made = await response.json().catch(() => ({}));
  if (!response.ok) {
    log(`design failed: ${made.error?.message ?? made.message ?? response.statusText}`);
    return;
  }
  log(`voice designed and stored: ${made.voice_id} (${made.description})`);
  await loadVoices();
  $("voice").value = made.voice_id;
  client.update({ voice: made.voice_id });
}

function drawMeter(c) {
  const analyser = c.audioContext.createAnalyser();
  analyser.fftSize = 1024;
  c.outputNode.connect(analyser);
  const canvas = $("meter");
  const g = canvas.getContext("2d");
  const samples = new Float32Array(analyser.fftSize);
  const colour = getComputedStyle(document.documentElement).getPropertyValue("--accent").trim() || "#0b57d0";
  const frame = () => {
    analyser.getFloatTimeDomainData(samples);
    const { width, height } = canvas;
    g.clearRect(0, 0, width, height);
    g.strokeStyle = colour;
    g.lineWidth = 2;
    g.beginPath();
    for (let i = 0; i < samples.length; i++) {
      const x = (i / (samples.length - 1)) * width;
      const y = height / 2 - samples[i] * (height / 2) * 0.9;
      if (i === 0) g.moveTo(x, y);
      else g.lineTo(x, y);
    }
    g.stroke();
    requestAnimationFrame(frame);
  };
  frame();
}

function exposeTestHook(c) {
  window.__voxgateTest = {
    client: c,
    events,
    /** Decoded PCM of a turn: Float32Array at the AudioContext rate (48 kHz). */
    pcm: (contextId) => c.capturedPcm(contextId),
    /** The same as little-endian float32 bytes in base64 (cheap to move out of the page). */
    pcmBase64: (contextId) => {
      const bytes = new Uint8Array(c.capturedPcm(contextId).buffer);
      let text = "";
      for (let i = 0; i < bytes.length; i += 0x8000) text += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
      return btoa(text);
    },
    /** Fresh player stats: {bufferedMs, underruns, cushionMs, playing, playedMs: {context: ms}}. */
    stats: () =>
      new Promise((resolve) => {
        const onMessage = (e) => {
          if (e.data.type !== "stats") return;
          c.player.port.removeEventListener("message", onMessage);
          resolve(e.data);
        };
        c.player.port.addEventListener("message", onMessage);
        c.player.port.postMessage({ type: "stats" });
      }),
    contexts: () => [...c.contexts.keys()],
  };
}

$("speak").addEventListener("click", guarded(speak));
$("stream").addEventListener("click", guarded(streamLikeLlm));
$("cancel").addEventListener("click", guarded(bargeIn));
$("rate").addEventListener("input", () => ($("rate-value").value = $("rate").value));
$("voice").addEventListener("change", guarded(() => client.update({ voice: $("voice").value || null })));
$("format").addEventListener("change", guarded(() => client.update({ output: chosenOutput() })));
$("upload").addEventListener("submit", (e) => guarded(() => uploadVoice(e))());
$("design").addEventListener("submit", (e) => guarded(() => designVoice(e))());
$("style").addEventListener("change", guarded(() => client.update({ generation: { instruction: chosenStyle() } })));
start();
