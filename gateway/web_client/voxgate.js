// voxgate browser client: an ES module, no build step.
//
//   import { connect } from "/voxgate.js";
//   const vg = await connect("ws://host/v1/stream", { voice: null });
//   vg.addEventListener("context.done", (e) => console.log(e.detail.metrics));
//   vg.append("Hello there, ");  vg.append("how are you?");  vg.end();
//   vg.cancel();  // barge-in: silent at once, the server stops generating
//
// Audio arrives as binary frames (header + payload). Opus is decoded with WebCodecs AudioDecoder; where the
// browser has none, the client asks the server for 48 kHz PCM instead (feature detection, not browser sniffing).
// Playback runs in an AudioWorklet ring buffer (player-worklet.js) that reports what the listener has heard; the
// client forwards that to the server as playback.position, which drives pacing and the barge-in report.

// magic u8, version u8, kind u8, flags u8, index u16, seq u32, pts_ms u32: 14 bytes (gateway/audio.py HEADER_SIZE)
export const FRAME_HEADER_BYTES = 14;
export const FRAME_MAGIC = 0x56;
export const PROTOCOL_VERSION = 1;
export const FrameKind = Object.freeze({ OPUS: 1, PCM_S16LE: 2, MULAW: 3, ALAW: 4 });
const FRAME_BIG_ENDIAN = true; // network byte order: gateway/audio.py pack_frame_header, struct "!BBBBHII"
const OPUS_LOOKAHEAD_48K = 312; // encoder delay: the first samples of each decoded turn precede its audio
const PLAYBACK_RATE = 48000;
const PING_EVERY_MS = 20000;
const METRICS_EVERY_MS = 250;
const BITRATE_WINDOW_MS = 2000;

/** A client-side failure with a stable code (e.g. "not_connected", "bad_frame", "decode_error"). */
export class VoxgateError extends Error {
  constructor(code, message) {
    super(message);
    this.name = "VoxgateError";
    this.code = code;
  }
}

/** True when this browser can decode raw Opus packets (WebCodecs). */
export function canDecodeOpus() {
  return typeof globalThis.AudioDecoder === "function" && typeof globalThis.EncodedAudioChunk === "function";
}

/** Parse one binary audio message: {kind, flags, index, seq, ptsMs, payload}; throws VoxgateError if malformed. */
export function parseFrame(buffer) {
  if (buffer.byteLength < FRAME_HEADER_BYTES) {
    throw new VoxgateError("bad_frame", `audio frame of ${buffer.byteLength} bytes is shorter than its header`);
  }
  const view = new DataView(buffer);
  const magic = view.getUint8(0);
  const version = view.getUint8(1);
  if (magic !== FRAME_MAGIC || version !== PROTOCOL_VERSION) {
    throw new VoxgateError("bad_frame", `not a voxgate v1 audio frame (magic ${magic}, version ${version})`);
  }
  const little = !FRAME_BIG_ENDIAN;
  return {
    kind: view.getUint8(2),
    flags: view.getUint8(3),
    index: view.getUint16(4, little),
    seq: view.getUint32(6, little),
    ptsMs: view.getUint32(10, little),
    payload: new Uint8Array(buffer, FRAME_HEADER_BYTES),
  };
}

/** Open a session: resolves once the server has answered session.start. */
export async function connect(url, options = {}) {
  const client = new VoxgateClient(url, options);
  await client.open();
  return client;
}

export class VoxgateClient extends EventTarget {
  /**
   * @param {string} url  ws(s)://host/v1/stream
   * @param {object} options  token, getToken (async, for reconnects with single-use tokens), voice, output,
   *   chunking, generation, audioContext, workletUrl, capture (keep decoded PCM per turn), reconnect (default true)
   */
  constructor(url, options = {}) {
    super();
    this.url = url;
    this.options = { reconnect: true, maxBackoffMs: 5000, ...options };
    this.fallback = false; // true when Opus was wanted but this browser cannot decode it
    this.output = this.chooseOutput(options.output);
    this.socket = null;
    this.session = null; // the session.started message
    this.state = "idle"; // idle | connecting | open | reconnecting | closed
    this.contexts = new Map(); // context_id -> turn state
    this.byIndex = new Map(); // frame header index -> context_id
    this.current = null; // the turn that append() without a context feeds
    this.turns = 0;
    this.attempt = 0;
    this.audioContext = options.audioContext ?? null;
    this.player = null;
    this.playerStats = { bufferedMs: 0, underruns: 0, cushionMs: 0, playing: false, playedMs: {} };
    this.received = []; // [time, bytes] of audio frames, for the bitrate readout
    this.captured = new Map(); // context_id -> [Float32Array] (when options.capture)
    this.flushWaiters = [];
    this.timers = [];
  }

  // Opus where WebCodecs can decode it, otherwise 48 kHz PCM from the server.
  chooseOutput(requested = {}) {
    const output = { ...requested };
    output.format ??= "opus";
    if (output.format === "opus" && !canDecodeOpus()) {
      output.format = "pcm_s16le";
      output.sample_rate = PLAYBACK_RATE;
      delete output.bitrate;
      this.fallback = true;
    }
    if (output.format === "opus" || output.format === "pcm_s16le") output.sample_rate ??= PLAYBACK_RATE;
    return output;
  }

  get outputFormat() {
    return this.output.format;
  }

  /** The audio graph's last node (connect an AnalyserNode to it for meters). */
  get outputNode() {
    return this.player;
  }

  async open() {
    await this.startAudio();
    this.timers.push(setInterval(() => this.ping(), PING_EVERY_MS));
    this.timers.push(setInterval(() => this.emitMetrics(), METRICS_EVERY_MS));
    await this.openSocket();
  }

  async startAudio() {
    if (!this.audioContext) {
      this.audioContext = new AudioContext({ sampleRate: PLAYBACK_RATE, latencyHint: "interactive" });
    }
    const workletUrl = this.options.workletUrl ?? new URL("./player-worklet.js", import.meta.url);
    await this.audioContext.audioWorklet.addModule(workletUrl);
    this.player = new AudioWorkletNode(this.audioContext, "voxgate-player", { outputChannelCount: [1] });
    this.player.port.onmessage = (event) => this.onPlayerMessage(event.data);
    this.player.connect(this.audioContext.destination);
    // Autoplay policy: resume() needs a user gesture in most browsers; append() tries again.
    this.audioContext.resume().catch(() => {});
  }

  async openSocket() {
    this.state = this.attempt === 0 ? "connecting" : "reconnecting";
    const token = this.options.getToken ? await this.options.getToken() : this.options.token;
    const url = new URL(this.url, location.href);
    if (url.protocol === "http:") url.protocol = "ws:";
    if (url.protocol === "https:") url.protocol = "wss:";
    if (token) url.searchParams.set("token", token);
    return new Promise((resolve, reject) => {
      const socket = new WebSocket(url);
      socket.binaryType = "arraybuffer";
      this.socket = socket;
      let started = false;
      socket.onopen = () => {
        this.sendJson({
          type: "session.start",
          ...(this.options.voice ? { voice: this.options.voice } : {}), // absent: the server's default voice
          output: this.output,
          ...(this.options.chunking ? { chunking: this.options.chunking } : {}),
          ...(this.options.generation ? { generation: this.options.generation } : {}),
        });
      };
      socket.onmessage = (event) => {
        if (typeof event.data !== "string") return this.onFrame(event.data);
        let msg;
        try {
          msg = JSON.parse(event.data);
        } catch {
          return this.emit("error", { code: "bad_json", message: "the server sent a text frame that is not JSON" });
        }
        if (msg.type === "session.started") {
          started = true;
          this.onSessionStarted(msg);
          resolve(this);
        } else if (!started && msg.type === "error") {
          // session.start was refused (bad settings, unknown voice): retrying the same would fail the same way.
          reject(new VoxgateError(msg.code, msg.message));
          this.state = "closed";
          socket.close(1000);
        }
        this.onMessage(msg);
      };
      socket.onclose = (event) => {
        if (this.socket !== socket) return;
        if (!started) reject(new VoxgateError("connect_failed", `could not open a session (close ${event.code})`));
        this.onClose(event);
      };
    });
  }

  onSessionStarted(msg) {
    const reconnected = this.attempt > 0 || this.session !== null;
    this.session = msg;
    this.state = "open";
    this.attempt = 0;
    this.emit(reconnected ? "reconnected" : "open", msg);
    this.emit("session", msg);
  }

  onClose(event) {
    this.socket = null;
    for (const [id, turn] of this.contexts) {
      if (["open", "ending", "cancelling"].includes(turn.state)) this.finishTurn(id, "lost", { code: event.code });
    }
    this.current = null;
    this.byIndex.clear();
    // Reconnect only a session that once worked: a first connect that fails is the caller's to handle.
    if (this.state === "closed" || !this.options.reconnect || this.session === null) {
      this.state = "closed";
      for (const timer of this.timers) clearInterval(timer);
      this.emit("close", { code: event.code, reason: event.reason });
      return;
    }
    // Exponential backoff with jitter so a restarted server is not stampeded by every client at once.
    const base = Math.min(this.options.maxBackoffMs, 250 * 2 ** this.attempt);
    const delay = base / 2 + Math.random() * (base / 2);
    this.attempt += 1;
    this.state = "reconnecting";
    this.emit("reconnecting", { attempt: this.attempt, delayMs: delay, code: event.code });
    setTimeout(() => {
      if (this.state === "closed") return;
      this.openSocket().catch(() => {}); // a failed attempt closes, and onClose schedules the next one
    }, delay);
  }

  // --------------------------------------------------------------------------------------------- sending

  sendJson(msg) {
    if (!this.socket || this.socket.readyState !== WebSocket.OPEN) {
      throw new VoxgateError("not_connected", `cannot send ${msg.type}: the session is ${this.state}`);
    }
    this.socket.send(JSON.stringify(msg));
  }

  newContextId() {
    this.turns += 1;
    return `turn-${this.turns}-${Math.random().toString(36).slice(2, 8)}`;
  }

  turn(contextId) {
    let turn = this.contexts.get(contextId);
    if (!turn) {
      turn = {
        id: contextId,
        state: "open",
        index: null,
        output: this.output,
        firstTextAt: performance.now(),
        firstAudioAt: null,
        decoder: null,
        skip: 0, // decoded samples still to drop (the Opus lookahead)
        done: null,
      };
      turn.finished = new Promise((resolve) => (turn.done = resolve));
      this.contexts.set(contextId, turn);
    }
    return turn;
  }

  /** More text for a turn (the current one unless `context` is given); opens the turn if new. Returns its id. */
  append(text, { context } = {}) {
    if (typeof text !== "string") throw new VoxgateError("invalid_value", "append(text): text must be a string");
    const id = context ?? this.current ?? this.newContextId();
    const turn = this.turn(id);
    if (turn.state !== "open") throw new VoxgateError("context_closed", `turn ${id} is ${turn.state}`);
    if (!context) this.current = id;
    this.audioContext?.resume().catch(() => {});
    this.sendJson({ type: "text.append", context_id: id, text });
    return id;
  }

  /** Synthesise everything buffered in the turn now; resolves with text.flushed. */
  flush({ context, flushId } = {}) {
    const id = context ?? this.current;
    if (!id) throw new VoxgateError("unknown_context", "flush(): no open turn");
    const flush_id = flushId ?? `flush-${Math.random().toString(36).slice(2, 10)}`;
    this.sendJson({ type: "text.flush", context_id: id, flush_id });
    return new Promise((resolve) => this.flushWaiters.push({ flush_id, resolve }));
  }

  /** No more text for the turn; resolves when it has finished ({status: "done" | "cancelled" | "lost", ...}). */
  end({ context } = {}) {
    const id = context ?? this.current;
    if (!id) throw new VoxgateError("unknown_context", "end(): no open turn");
    const turn = this.turn(id);
    if (id === this.current) this.current = null;
    if (turn.state === "open") {
      turn.state = "ending";
      this.sendJson({ type: "context.end", context_id: id });
    }
    return turn.finished;
  }

  /**
   * Barge-in: silence playback at once and stop the server. Cancels `context`, or every unfinished turn.
   * Reports the exact heard position first, so the server's context.cancelled tells what the listener heard.
   */
  async cancel({ context } = {}) {
    const ids = context ? [context] : [...this.contexts.values()].filter((t) => t.state !== "done").map((t) => t.id);
    const live = ids.filter((id) => ["open", "ending"].includes(this.contexts.get(id)?.state));
    for (const id of live) this.contexts.get(id).state = "cancelling";
    for (const turn of this.contexts.values()) {
      if (turn.state === "draining") closeDecoder(turn); // finished on the server, but must not be heard now
    }
    if (this.current && live.includes(this.current)) this.current = null;
    const positions = await this.flushPlayer();
    for (const id of live) {
      closeDecoder(this.contexts.get(id));
      if (positions[id] !== undefined) {
        this.trySend({ type: "playback.position", context_id: id, played_ms: positions[id] });
      }
      if (!this.trySend({ type: "context.cancel", context_id: id })) this.finishTurn(id, "cancelled", {});
    }
    return Promise.all(live.map((id) => this.contexts.get(id).finished));
  }

  /** Change voice, output and/or generation settings (e.g. { instruction: "cheerful" }) for turns opened from now on
   *  (session.update); kept across reconnects. */
  update({ voice, output, generation } = {}) {
    const msg = { type: "session.update" };
    if (voice !== undefined) msg.voice = this.options.voice = voice;
    if (output !== undefined) msg.output = this.output = this.chooseOutput(output);
    if (generation !== undefined) msg.generation = this.options.generation = { ...this.options.generation, ...generation };
    this.sendJson(msg);
  }

  ping() {
    this.trySend({ type: "ping" });
  }

  // For messages that lose nothing when dropped while the socket is down (the next one supersedes them).
  trySend(msg) {
    if (this.socket?.readyState !== WebSocket.OPEN) return false;
    this.socket.send(JSON.stringify(msg));
    return true;
  }

  /** Orderly close; no reconnect. */
  close() {
    this.state = "closed";
    for (const timer of this.timers) clearInterval(timer);
    if (this.socket?.readyState === WebSocket.OPEN) {
      this.socket.send(JSON.stringify({ type: "session.end" }));
      this.socket.close(1000);
    }
    this.audioContext?.close?.().catch(() => {});
  }

  // --------------------------------------------------------------------------------------------- receiving

  onMessage(msg) {
    const turn = msg.context_id ? this.contexts.get(msg.context_id) : null;
    switch (msg.type) {
      case "context.started":
        if (turn) {
          turn.index = msg.index;
          turn.output = msg.output ?? this.output;
          this.byIndex.set(msg.index, msg.context_id);
        }
        break;
      case "text.flushed": {
        const i = this.flushWaiters.findIndex((w) => w.flush_id === msg.flush_id);
        if (i >= 0) this.flushWaiters.splice(i, 1)[0].resolve(msg);
        break;
      }
      case "context.done":
        if (turn) this.finishTurn(msg.context_id, "done", msg);
        break;
      case "context.cancelled":
        if (turn) this.finishTurn(msg.context_id, "cancelled", msg);
        break;
      case "error":
        if (turn && msg.fatal !== true && ["open", "ending"].includes(turn.state) && this.isTurnFatal(msg.code)) {
          this.finishTurn(msg.context_id, "failed", msg);
        }
        break;
    }
    this.emit(msg.type, msg);
  }

  // Errors that end the turn they name (docs/PROTOCOL.md); others only drop the offending message.
  isTurnFatal(code) {
    return ["unknown_voice", "engine_error", "overloaded", "too_many_contexts", "server_shutdown", "internal_error"]
      .includes(code);
  }

  onFrame(buffer) {
    let frame;
    try {
      frame = parseFrame(buffer);
    } catch (error) {
      return this.emit("error", { code: error.code, message: error.message });
    }
    this.received.push([performance.now(), buffer.byteLength]);
    const id = this.byIndex.get(frame.index);
    const turn = id ? this.contexts.get(id) : null;
    if (!turn || !["open", "ending"].includes(turn.state)) return; // late frames of a cancelled turn
    if (turn.firstAudioAt === null) {
      turn.firstAudioAt = performance.now();
      this.emit("first-audio", { context_id: id, ttfbMs: turn.firstAudioAt - turn.firstTextAt });
    }
    if (frame.kind === FrameKind.OPUS) return this.decodeOpus(turn, frame);
    let samples;
    try {
      samples = decodeSamples(frame.kind, frame.payload);
    } catch (error) {
      return this.emit("error", { code: error.code, context_id: id, message: error.message });
    }
    this.deliver(turn, samples, turn.output.sample_rate ?? PLAYBACK_RATE);
  }

  decodeOpus(turn, frame) {
    if (!turn.decoder) {
      if (!canDecodeOpus()) {
        this.emit("error", { code: "decode_error", context_id: turn.id, message: "Opus audio but no WebCodecs" });
        return;
      }
      // One decoder per turn: each turn is its own Opus stream on the server.
      turn.decoder = new AudioDecoder({
        output: (data) => {
          const samples = new Float32Array(data.numberOfFrames);
          data.copyTo(samples, { planeIndex: 0, format: "f32-planar" });
          const rate = data.sampleRate;
          data.close();
          this.deliver(turn, samples, rate);
        },
        error: (error) => this.emit("error", { code: "decode_error", context_id: turn.id, message: String(error) }),
      });
      turn.decoder.configure({ codec: "opus", sampleRate: PLAYBACK_RATE, numberOfChannels: 1 });
      turn.skip = OPUS_LOOKAHEAD_48K;
    }
    if (turn.decoder.state === "closed") return; // it failed; the error event has told the app
    turn.decoder.decode(
      new EncodedAudioChunk({ type: "key", timestamp: frame.ptsMs * 1000, data: frame.payload }),
    );
  }

  // Decoded audio of a turn -> capture (tests) and the player, at the AudioContext's rate.
  deliver(turn, samples, rate) {
    if (!["open", "ending", "draining"].includes(turn.state)) return;
    if (rate !== this.audioContext.sampleRate) samples = resampleLinear(samples, rate, this.audioContext.sampleRate);
    if (this.options.capture) {
      if (!this.captured.has(turn.id)) this.captured.set(turn.id, []);
      this.captured.get(turn.id).push(samples);
    }
    if (turn.skip > 0) {
      const n = Math.min(turn.skip, samples.length);
      turn.skip -= n;
      samples = samples.subarray(n);
    }
    if (samples.length) this.player.port.postMessage({ type: "push", context: turn.id, samples });
  }

  async finishTurn(id, status, detail) {
    const turn = this.contexts.get(id);
    if (!turn || turn.state === "done" || turn.state === "draining") return;
    const wasPlaying = ["open", "ending"].includes(turn.state);
    if (this.current === id) this.current = null;
    if (status === "done" && turn.decoder) {
      turn.state = "draining"; // the last packets' audio comes out before the player hears "end"
      try {
        await turn.decoder.flush();
      } catch {
        // closed by a barge-in meanwhile
      }
    }
    turn.state = "done";
    closeDecoder(turn);
    if (wasPlaying) this.player?.port.postMessage({ type: "end", context: id });
    if (turn.index !== null && this.byIndex.get(turn.index) === id) this.byIndex.delete(turn.index);
    const result = { status, context_id: id, ...detail };
    turn.done(result);
    this.emit("turn.finished", result); // after the decoder has drained: all of the turn's audio is queued
  }

  // --------------------------------------------------------------------------------------------- playback

  flushPlayer() {
    return new Promise((resolve) => {
      const positions = {};
      const onMessage = (event) => {
        const msg = event.data;
        if (msg.type === "position") positions[msg.context] = msg.playedMs;
        if (msg.type === "flushed") finish();
      };
      const finish = () => {
        this.player.port.removeEventListener("message", onMessage);
        clearTimeout(timer);
        resolve(positions);
      };
      const timer = setTimeout(finish, 100);
      this.player.port.addEventListener("message", onMessage);
      this.player.port.postMessage({ type: "flush" });
    });
  }

  onPlayerMessage(msg) {
    if (msg.type === "position") {
      const turn = this.contexts.get(msg.context);
      this.playerStats.playedMs[msg.context] = msg.playedMs;
      if (turn && ["open", "ending"].includes(turn.state)) {
        this.trySend({ type: "playback.position", context_id: msg.context, played_ms: msg.playedMs });
      }
    } else if (msg.type === "stats") {
      this.playerStats = { ...msg, playedMs: { ...msg.playedMs } }; // a copy: positions update it in place
    } else if (msg.type === "underrun") {
      this.playerStats.underruns = msg.underruns;
      this.emit("underrun", msg);
    } else if (msg.type === "idle") {
      this.emit("idle", {});
    }
  }

  emitMetrics() {
    this.player?.port.postMessage({ type: "stats" });
    const now = performance.now();
    this.received = this.received.filter(([t]) => now - t < BITRATE_WINDOW_MS);
    const bytes = this.received.reduce((sum, [, n]) => sum + n, 0);
    this.emit("metrics", { ...this.metrics(), bitrateKbps: (bytes * 8) / BITRATE_WINDOW_MS });
  }

  /** Live numbers: buffered audio, underruns, cushion, and the last turn's time to first audio. */
  metrics() {
    const last = [...this.contexts.values()].reverse().find((t) => t.firstAudioAt !== null);
    return {
      bufferedMs: this.playerStats.bufferedMs,
      underruns: this.playerStats.underruns,
      cushionMs: this.playerStats.cushionMs,
      playing: this.playerStats.playing,
      ttfbMs: last ? last.firstAudioAt - last.firstTextAt : null,
      state: this.state,
      format: this.output.format,
    };
  }

  /** Decoded PCM of a turn as one Float32Array at the AudioContext rate (needs options.capture). */
  capturedPcm(contextId) {
    const chunks = this.captured.get(contextId) ?? [];
    const out = new Float32Array(chunks.reduce((n, c) => n + c.length, 0));
    let offset = 0;
    for (const c of chunks) {
      out.set(c, offset);
      offset += c.length;
    }
    return out;
  }

  emit(type, detail) {
    this.dispatchEvent(new CustomEvent(type, { detail }));
  }
}

function closeDecoder(turn) {
  if (turn.decoder && turn.decoder.state !== "closed") turn.decoder.close();
  turn.decoder = null;
}

// --------------------------------------------------------------------------------------------- sample formats

function decodeSamples(kind, payload) {
  if (kind === FrameKind.PCM_S16LE) {
    const view = new DataView(payload.buffer, payload.byteOffset, payload.byteLength);
    const out = new Float32Array(payload.byteLength >> 1);
    for (let i = 0; i < out.length; i++) out[i] = view.getInt16(2 * i, true) / 32768;
    return out;
  }
  if (kind === FrameKind.MULAW || kind === FrameKind.ALAW) {
    const decode = kind === FrameKind.MULAW ? ulawToLinear : alawToLinear;
    const out = new Float32Array(payload.length);
    for (let i = 0; i < out.length; i++) out[i] = decode(payload[i]) / 32768;
    return out;
  }
  throw new VoxgateError("bad_frame", `unknown audio frame kind ${kind}`);
}

// G.711 expansion (ITU-T G.711, as in Sun's g711.c).
function ulawToLinear(code) {
  code = ~code & 0xff;
  let t = ((code & 0x0f) << 3) + 0x84;
  t <<= (code & 0x70) >> 4;
  return code & 0x80 ? 0x84 - t : t - 0x84;
}

function alawToLinear(code) {
  code ^= 0x55;
  let t = (code & 0x0f) << 4;
  const segment = (code & 0x70) >> 4;
  if (segment === 0) t += 8;
  else if (segment === 1) t += 0x108;
  else t = (t + 0x108) << (segment - 1);
  return code & 0x80 ? t : -t;
}

// Telephony rates are rare in a browser; linear interpolation is enough to listen to them (chunk edges may click).
function resampleLinear(samples, from, to) {
  const out = new Float32Array(Math.round((samples.length * to) / from));
  const step = from / to;
  for (let i = 0; i < out.length; i++) {
    const x = i * step;
    const j = Math.floor(x);
    const a = samples[j] ?? 0;
    const b = samples[j + 1] ?? a;
    out[i] = a + (b - a) * (x - j);
  }
  return out;
}
