// voxgate AudioWorklet player: one ring buffer for every turn, so audio stays gapless across chunks and turns.
//
// Messages in (port):
//   {type: "push", context, samples: Float32Array}  queue audio of a turn (at the AudioContext's sample rate)
//   {type: "end", context}                           no more audio for this turn: play out its tail without a cushion
//   {type: "flush"}                                  barge-in: drop everything queued; silent from the next quantum
//   {type: "stats"}                                  ask for a stats message now
// Messages out:
//   {type: "position", context, playedMs}            audio the listener has heard per turn (every ~100 ms and on flush)
//   {type: "stats", bufferedMs, underruns, cushionMs, playing, playedMs: {context: ms}}
//   {type: "underrun", context, underruns, cushionMs}
//   {type: "idle"}                                   everything queued has been played
//   {type: "flushed"}                                the flush is done (after its final position reports)

const MIN_CUSHION_MS = 60;
const MAX_CUSHION_MS = 400;
const CUSHION_STEP_MS = 40;
const REPORT_EVERY_MS = 100;

class RingBuffer {
  constructor(capacity) {
    this.data = new Float32Array(capacity);
    this.read = 0;
    this.length = 0;
  }

  push(samples) {
    if (this.length + samples.length > this.data.length) this.grow(this.length + samples.length);
    let write = (this.read + this.length) % this.data.length;
    let offset = 0;
    while (offset < samples.length) {
      const n = Math.min(samples.length - offset, this.data.length - write);
      this.data.set(samples.subarray(offset, offset + n), write);
      offset += n;
      write = (write + n) % this.data.length;
    }
    this.length += samples.length;
  }

  /** Moves up to out.length samples into out; returns how many. */
  pull(out) {
    const n = Math.min(out.length, this.length);
    let copied = 0;
    while (copied < n) {
      const m = Math.min(n - copied, this.data.length - this.read);
      out.set(this.data.subarray(this.read, this.read + m), copied);
      this.read = (this.read + m) % this.data.length;
      copied += m;
    }
    this.length -= n;
    return n;
  }

  grow(needed) {
    let capacity = this.data.length * 2;
    while (capacity < needed) capacity *= 2;
    const data = new Float32Array(capacity);
    const length = this.length;
    this.pull(data.subarray(0, length));
    this.data = data;
    this.read = 0;
    this.length = length;
  }

  clear() {
    this.read = 0;
    this.length = 0;
  }
}

class VoxgatePlayer extends AudioWorkletProcessor {
  constructor() {
    super();
    this.ring = new RingBuffer(sampleRate * 4);
    this.spans = []; // [{context, samples}] in play order: which turn each queued sample belongs to
    this.ended = new Set(); // turns with no more audio coming
    this.played = new Map(); // context -> samples played
    this.dirty = new Set(); // turns whose position changed since the last report
    this.current = null; // the turn heard last
    this.starved = null; // a turn that ran dry before its end: an underrun if more of it arrives
    this.cushionMs = MIN_CUSHION_MS;
    this.playing = false;
    this.underruns = 0;
    this.sinceReportMs = 0;
    this.port.onmessage = (event) => this.onMessage(event.data);
  }

  onMessage(msg) {
    if (msg.type === "push") this.push(msg.context, msg.samples);
    else if (msg.type === "end") {
      this.ended.add(msg.context);
      if (this.starved === msg.context) {
        this.starved = null;
        this.port.postMessage({ type: "idle" });
      }
    } else if (msg.type === "flush") {
      this.ring.clear();
      this.spans = [];
      this.playing = false;
      this.starved = null;
      this.reportPositions();
      this.port.postMessage({ type: "flushed" });
    } else if (msg.type === "stats") this.postStats();
  }

  push(context, samples) {
    if (this.starved !== null) {
      // The listener heard a gap inside a turn: count it and hold a larger cushion from now on.
      if (this.starved === context) {
        this.underruns += 1;
        this.cushionMs = Math.min(MAX_CUSHION_MS, this.cushionMs + CUSHION_STEP_MS);
        this.port.postMessage({ type: "underrun", context, underruns: this.underruns, cushionMs: this.cushionMs });
      }
      this.starved = null;
    }
    this.ring.push(samples);
    const last = this.spans[this.spans.length - 1];
    if (last && last.context === context) last.samples += samples.length;
    else this.spans.push({ context, samples: samples.length });
  }

  bufferedMs() {
    return (this.ring.length / sampleRate) * 1000;
  }

  // Start once the cushion is full, or at once when every queued turn is complete (nothing more to wait for).
  readyToStart() {
    if (this.ring.length === 0) return false;
    if (this.bufferedMs() >= this.cushionMs) return true;
    return this.spans.every((span) => this.ended.has(span.context));
  }

  process(inputs, outputs) {
    const channels = outputs[0];
    const out = channels[0];
    out.fill(0);
    if (!this.playing && this.readyToStart()) this.playing = true;
    if (this.playing) {
      const n = this.ring.pull(out);
      this.credit(n);
      if (n < out.length) this.onEmpty();
    }
    for (let ch = 1; ch < channels.length; ch++) channels[ch].set(out);
    this.sinceReportMs += (out.length / sampleRate) * 1000;
    if (this.sinceReportMs >= REPORT_EVERY_MS) {
      this.sinceReportMs = 0;
      this.reportPositions();
    }
    return true;
  }

  credit(count) {
    while (count > 0 && this.spans.length > 0) {
      const span = this.spans[0];
      const n = Math.min(count, span.samples);
      span.samples -= n;
      count -= n;
      this.played.set(span.context, (this.played.get(span.context) ?? 0) + n);
      this.dirty.add(span.context);
      this.current = span.context;
      if (span.samples === 0) this.spans.shift();
    }
  }

  onEmpty() {
    this.playing = false;
    this.reportPositions();
    if (this.current !== null && !this.ended.has(this.current)) this.starved = this.current;
    else this.port.postMessage({ type: "idle" });
  }

  reportPositions() {
    for (const context of this.dirty) {
      const playedMs = ((this.played.get(context) ?? 0) / sampleRate) * 1000;
      this.port.postMessage({ type: "position", context, playedMs });
    }
    this.dirty.clear();
  }

  postStats() {
    const playedMs = {};
    for (const [context, samples] of this.played) playedMs[context] = (samples / sampleRate) * 1000;
    this.port.postMessage({
      type: "stats",
      bufferedMs: this.bufferedMs(),
      underruns: this.underruns,
      cushionMs: this.cushionMs,
      playing: this.playing,
      playedMs,
    });
  }
}

registerProcessor("voxgate-player", VoxgatePlayer);
