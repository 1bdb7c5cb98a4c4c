"""Routing: which worker a new request goes to (`pick_worker`, by `headroom`), and how devices form workers
(`device_groups`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from engine.errors import EngineOverloaded, InvalidParameter
from engine.worker_handle import WorkerHandle

LATE_SLACK_MS = 300.0  # a worker whose most starved settled listener has less than this buffered is running late


def pick_worker(workers: Sequence[WorkerHandle], max_num_seqs: int, max_waiting: int) -> WorkerHandle:
    """The ready worker with the most headroom (fewest requests in flight on a tie); `EngineOverloaded` when even it
    holds `max_num_seqs` running and `max_waiting` waiting requests."""
    worker = max(workers, key=lambda w: (w.ready.is_set() and w.alive,
                                         headroom(w.stats, len(w.in_flight), max_num_seqs), -len(w.in_flight)))
    if len(worker.in_flight) >= max_num_seqs + max_waiting:
        raise EngineOverloaded(f"{len(worker.in_flight)} requests in flight on the least loaded worker "
                               f"(limit {max_num_seqs} running + {max_waiting} waiting)")
    return worker


def headroom(stats: dict[str, Any], in_flight: int, max_num_seqs: int) -> float:
    """How much more a worker can take, from the stats it reports every step: the tighter of its free sequence
    room and its free KV blocks (both fractions), less one whole unit while it is late on a deadline (a listener
    about to starve), so a late worker gets new turns only when every worker is late."""
    seqs = max(in_flight, int(stats.get("running", 0)) + int(stats.get("waiting", 0)))
    room = 1.0 - seqs / max_num_seqs
    total = stats.get("total_blocks") or 0
    if total:  # requests routed since the last report hold no blocks yet: charge them the average
        used = total - stats.get("free_blocks", total) - stats.get("voice_blocks", 0)
        reported = int(stats.get("running", 0)) + int(stats.get("waiting", 0))
        unseen = max(0, in_flight - reported)
        per_seq = used / reported if reported else 0.0
        room = min(room, (stats.get("free_blocks", total) - unseen * per_seq) / total)
    slack = stats.get("min_slack_ms")
    if slack is not None and slack < LATE_SLACK_MS:
        room -= 1.0
    return room


def device_groups(devices: Sequence[int | str] | None, tp: int) -> list[list[str]]:
    """Device names, one list per worker: `tp` consecutive devices form one tensor-parallel group.

    `devices` holds CUDA indices (0, 1) or torch device names ("cuda:1", "cpu"); "cpu" may repeat, for several CPU
    workers (or ranks). Default: the first `tp` GPUs, or `tp` CPU ranks without a GPU."""
    if devices is None:
        devices = list(range(tp)) if torch.cuda.is_available() else ["cpu"] * tp
    if not isinstance(devices, (list, tuple)) or not devices:
        raise InvalidParameter("devices must be a non-empty list of CUDA indices or device names")
    names = []
    for d in devices:
        try:
            dev = torch.device(f"cuda:{d}" if isinstance(d, int) and not isinstance(d, bool) else d)
        except (RuntimeError, TypeError):
            raise InvalidParameter(f"devices: {d!r} is neither a CUDA index nor a device name") from None
        if dev.type == "cuda" and not (torch.cuda.is_available() and (dev.index or 0) < torch.cuda.device_count()):
            raise InvalidParameter(f"devices: {d!r} is not a CUDA device available here")
        if dev.type not in ("cuda", "cpu"):
            raise InvalidParameter(f"devices: {d!r}: only CUDA devices and the CPU are supported")
        names.append(f"cuda:{dev.index or 0}" if dev.type == "cuda" else "cpu")
    if len(names) % tp:
        raise InvalidParameter(f"{len(names)} devices do not split into tensor-parallel groups of {tp}")
    groups = [names[i:i + tp] for i in range(0, len(names), tp)]
    for g in groups:
        if len({torch.device(n).type for n in g}) > 1:
            raise InvalidParameter(f"a tensor-parallel group cannot mix the CPU and GPUs ({g})")
        if g[0] != "cpu" and len(set(g)) < len(g):
            raise InvalidParameter(f"a tensor-parallel group needs distinct GPUs ({g})")
    return groups
