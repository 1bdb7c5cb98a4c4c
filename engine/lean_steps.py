"""Lean steps: a listener waiting for its first audio waits behind shorter steps (`VOXGATE_LEAN_STEPS`, in ms).

With a few hundred streams speaking, a step that advances all of them is long (~70 ms on an H200 at 400 gateway
sessions), and a new turn's first segment waits for the step on the device, the one launched behind it and its own.
Many of those streams need no patch that soon: the gateway reports how much audio each turn's listener has queued
(`Buffered`), and one with plenty queued loses nothing by sitting out a step. With lean steps at N ms:

- a prompt's urgency before its first patch is its listener's queue when the caller reported one (a later segment of
  a turn whose earlier audio is still playing), else none (-inf: a turn's first segment, the most urgent);
- prompts whose listeners have at most N ms queued are needy and prefilled first, then the others (no prompt waits);
- a step that feeds a needy prompt leaves out the decodes of listeners that reported more than N ms queued: they
  decode in the next step that feeds none, or once their queue falls to N ms;
- while a waiting prompt cannot be admitted (no room), nobody sits out: finishing streams frees the room.

A listener that never reported (a caller without playout: the engine benchmark, an HTTP stream) never sits out, so
such callers get the same steps with lean steps on or off. The step's mean length stays what the load makes it (the
same audio is made either way); what changes is which steps the new turns wait behind (`bench/scheduler_sim.py`).
Sans-I/O: the scheduler asks, nothing here knows about steps or devices.
"""

from __future__ import annotations

from collections.abc import Callable

from engine.request import Request


def queued_ms(req: Request, now: float, patch_ms: float, unseen: int = 0) -> float:
    """Audio queued at `req`'s listener (`Request.buffered_ms`), counting a report made before its first patch."""
    if not req.generated and not unseen and req.reported_ms is not None:
        return req.reported_ms - 1000.0 * (now - req.reported_at)
    return req.buffered_ms(now, patch_ms, unseen)


def split_needy(prompts: list[Request], urgency: Callable[[Request], float],
                lean_ms: float) -> tuple[list[Request], list[Request]]:
    """`prompts` (in their order) whose listeners have at most `lean_ms` queued, and the others."""
    needy: list[Request] = []
    later: list[Request] = []
    for req in prompts:
        (needy if urgency(req) <= lean_ms else later).append(req)
    return needy, later


def leave_out(decodes: list[Request], urgency: Callable[[Request], float],
              lean_ms: float) -> tuple[list[Request], list[Request]]:
    """`decodes` (in their order) that run in a step feeding a needy prompt, and those that sit it out: listeners that
    reported more than `lean_ms` queued (an unreported queue is a guess: those always run)."""
    run: list[Request] = []
    out: list[Request] = []
    for req in decodes:
        (out if req.reported_ms is not None and urgency(req) > lean_ms else run).append(req)
    return run, out


class Listeners:
    """A request's listener carried over to the continuation that follows it, so a later segment's queue is known
    from its arrival. A caller that continues a stream (the gateway's later segments) sends as the new prompt's audio
    the patches the engine just made for the same listener, ending with the finished request's last patch; that patch
    (exact float32 bytes) finds the listener's queue as last estimated, and the new request starts from it (a report
    of its own replaces it). Bounded: `size` finished requests at most, each kept `keep_s`."""

    def __init__(self, size: int = 4096, keep_s: float = 30.0):
        self.size, self.keep_s = size, keep_s
        self.queues: dict[bytes, tuple[float, float]] = {}  # last patch -> (queued ms, when), oldest first

    def finished(self, req: Request, queued: float, now: float) -> None:
        """`req` ended with its listener `queued` ms ahead at `now` (only listeners that reported are kept)."""
        if req.reported_ms is None or not req.generated:
            return
        self.queues[req.generated[-1].float().numpy().tobytes()] = (queued, now)
        while len(self.queues) > self.size or self.queues[next(iter(self.queues))][1] < now - self.keep_s:
            del self.queues[next(iter(self.queues))]

    def adopt(self, req: Request) -> None:
        """A new `req` whose prompt ends with a finished request's last patch takes over its listener's queue."""
        if not req.spec.audio or req.reported_ms is not None:
            return
        found = self.queues.pop(req.spec.audio[-1][1][-1].astype("float32", copy=False).tobytes(), None)
        if found is not None:
            req.reported_ms, req.reported_at = found
