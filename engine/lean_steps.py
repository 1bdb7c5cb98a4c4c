"""Lean steps: a listener waiting for its first audio waits behind short steps (`VOXGATE_LEAN_STEPS`).

With a few hundred streams speaking, a step that advances all of them is long (tens of ms on an H200, more with
prompts in it), and a new turn's first segment waits for the step on the device, the one launched behind it and its
own. Most of those streams need no patch that soon: the gateway reports how much audio each turn's listener has
queued (`Buffered`), and one with seconds queued loses nothing by sitting out a step. With lean steps:

- a prompt's urgency before its first patch is its listener's queue when the caller reported one (a later segment of
  a turn whose earlier audio is still playing), else none (-inf: a turn's first segment, the most urgent);
- prompts whose listeners have less than `sit_out_ms` queued are needy and prefilled first; a step that carries a
  chunk of one leaves out the decodes of listeners that reported more than `sit_out_ms` queued, and the other
  prompts: those wait until their listener's queue falls under `sit_out_ms`, seconds before it would run dry;
- a step without a needy prompt advances everyone, as without lean steps.

A listener that never reported (a caller without playout: the engine benchmark, an HTTP stream) never sits out.
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
                sit_out_ms: float) -> tuple[list[Request], list[Request]]:
    """`prompts` (in their order) whose listeners have less than `sit_out_ms` queued, and the others."""
    needy: list[Request] = []
    later: list[Request] = []
    for req in prompts:
        (needy if urgency(req) <= sit_out_ms else later).append(req)
    return needy, later


def staying(decodes: list[Request]) -> list[Request]:
    """The `decodes` (all above `sit_out_ms`) that still run in a step feeding a needy prompt: those whose listener
    never reported (their queue is a guess)."""
    return [r for r in decodes if r.reported_ms is None]
