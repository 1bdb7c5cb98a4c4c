"""What running requests hold, taken and given back: admission, preemption and finishing for `engine.scheduler`.

A waiting request is admitted when a VAE slot and the KV blocks of its prompt are free (a small watermark of blocks
kept for the running decodes), and a LoRA slot when it names an adapter; the full blocks of its stored voice's prefix
are shared, not copied. A preempted request gives its KV blocks and LoRA slot back and waits again at the front (it
keeps its VAE slot, so its audio continues seamlessly when it is recomputed); a finished one gives everything back.
A voice prefix request that completes keeps its full blocks as the voice's (`VoicePrefix`).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.kv_cache import BlockManager
from engine.lora import AdapterSlots
from engine.request import Request, Status


@dataclass
class VoicePrefix:
    """A stored voice's prompt prefix in the KV cache, shared by its requests."""

    blocks: list[int]  # full blocks only, so no request ever writes into them
    length: int  # prefix positions


class Admissions:
    """The scheduler's requests (waiting, running) and what the running ones hold: KV blocks, VAE slots, LoRA slots.
    `Scheduler` picks the steps on top of it."""

    def __init__(self, *, max_num_seqs: int, num_blocks: int, block_size: int, loras: AdapterSlots | None = None):
        self.loras = loras  # LoRA slots: an admitted request holds its adapter's slot until it finishes or yields
        self.blocks = BlockManager(num_blocks, block_size)
        self.watermark = max(1, num_blocks // 100)
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.voices: dict[str, VoicePrefix] = {}
        self.free_slots = list(range(max_num_seqs - 1, -1, -1))  # VAE stream slots
        self.num_preemptions = 0

    def finish(self, req: Request, reason: str) -> None:
        """Frees everything the request holds, at once."""
        if req.status is Status.FINISHED:
            return
        if req.status is Status.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        req.status, req.stop_reason = Status.FINISHED, reason
        self.blocks.release(req.block_table)
        req.block_table = []
        self._release_lora(req)
        if req.vae_slot is not None:
            self.free_slots.append(req.vae_slot)
            req.vae_slot = None
        del self.requests[req.request_id]

    def remove_voice(self, voice_id: str) -> None:
        """Give a stored voice's prefix blocks back (its requests that share them keep theirs)."""
        voice = self.voices.pop(voice_id, None)
        if voice is not None:
            self.blocks.release(voice.blocks)

    def _admit_waiting(self, req: Request) -> bool:
        """Admit the waiting `req` (it runs from now on) when it can be; `_drop_admitted` takes it off `waiting`."""
        if not self._fits(req):
            return False
        if req.spec.lora is not None:
            slot = self.loras.acquire(req.spec.lora) if self.loras is not None else None
            if slot is None:  # every LoRA slot is held by a running request
                return False
            req.lora_slot = slot
        shared, need = self._prompt_blocks(req)
        req.block_table = self.blocks.share(shared) + self.blocks.allocate(need)
        req.num_computed = len(shared) * self.blocks.block_size
        if req.vae_slot is None and not req.spec.prefix_only:
            req.vae_slot = self.free_slots.pop()
        req.status = Status.RUNNING
        self.running.append(req)
        return True

    def _drop_admitted(self) -> None:
        """`waiting` without the requests admitted since: one pass, not a search per admission."""
        self.waiting = [r for r in self.waiting if r.status is Status.WAITING]

    def _fits(self, req: Request, spare_slots: int = 0, spare_blocks: int = 0) -> bool:
        """Whether a VAE slot and the KV blocks of the waiting `req`'s prompt are free (`spare_*` more of each
        counted), a small watermark of blocks kept for the running decodes."""
        if req.vae_slot is None and not req.spec.prefix_only and not self.free_slots and not spare_slots:
            return False
        need = self._prompt_blocks(req)[1]
        return self.blocks.num_free + spare_blocks - need >= (self.watermark if self.running else 0)

    def _prompt_blocks(self, req: Request) -> tuple[list[int], int]:
        """The full blocks of its stored voice that `req` shares, and how many more its sequence needs."""
        voice = self.voices.get(req.spec.voice_id) if req.spec.voice_id and not req.spec.prefix_only else None
        shared = voice.blocks if voice is not None and req.seq_len > voice.length else []
        return shared, self.blocks.blocks_for(req.seq_len) - len(shared)

    def _unadmit(self, admitted: list[tuple[Request, int | None]]) -> None:
        """Undo admissions (each with the VAE slot it held before), latest first: waiting again as they were."""
        for req, slot in reversed(admitted):
            assert self.running[-1] is req
            self.running.pop()
            self._unrun(req)
            if slot is None and req.vae_slot is not None:
                self.free_slots.append(req.vae_slot)
                req.vae_slot = None

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._unrun(req)
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.insert(0, req)

    def _unrun(self, req: Request) -> None:
        """`req`, taken off `running`, waits again: its KV blocks and LoRA slot go (its VAE slot stays)."""
        self.blocks.release(req.block_table)
        req.block_table, req.num_computed, req.status = [], 0, Status.WAITING
        self._release_lora(req)

    def _release_lora(self, req: Request) -> None:
        if req.lora_slot:
            assert self.loras is not None and req.spec.lora is not None
            self.loras.release(req.spec.lora)
            req.lora_slot = 0

    def _keep_as_voice(self, req: Request) -> None:
        full = req.seq_len // self.blocks.block_size
        voice_id = req.spec.voice_id
        assert voice_id is not None
        self.remove_voice(voice_id)
        self.voices[voice_id] = VoicePrefix(self.blocks.share(req.block_table[:full]), req.seq_len)
        self.finish(req, "stop")
