"""The Runner: a step launched and collected (graph path, tail, LoRA mode), built from one part per job."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.cuda_graphs import (
    DecodeResult,
    StepGraphs,
    buckets_for,
    eager_flat_key,
    large_lm_graph_keys,
    lm_graph_keys,
)
from engine.model import fp8
from engine.model.attention import PREFILL_ROWS, AttentionMetadata, KVCache, make_attention_backend
from engine.model.euler import RowSteps, evaluations
from engine.model.fusion import FUSED_KERNELS
from engine.model.parallel import agree_min, local_kv_stack, tp_size
from engine.runner.eager import EagerStep
from engine.runner.memory import CPU_KV_BLOCKS, Activations, GiB, MemoryBudget
from engine.runner.records import PendingStep, StepOutput, StepTiming
from engine.runner.staging import HostStaging, Staging, fed_rows
from engine.runner.vae_lane import VaeLane
from engine.runner.warm_up import WarmUp
from engine.scheduler import ScheduledSeq
from engine.step_tail import StepTail

if TYPE_CHECKING:
    from engine.checkpoint import LoadedModel
    from engine.worker import WorkerConfig

log = logging.getLogger(__name__)

GraphSets = tuple[StepGraphs, StepGraphs, StepGraphs]  # decode, sample, LM


class Runner:
    """Runs one scheduled step on the device (`engine.runner`). It launches and collects steps and composes one part
    per job, each built from what it needs: `host` (`Staging`), `vae_lane` (`VaeLane`), `budget` (`MemoryBudget`),
    `eager` (`EagerStep`), the warm-up (`WarmUp`) and the step's tail (`StepTail`)."""

    def __init__(self, loaded: LoadedModel, cfg: WorkerConfig):
        self.config = loaded.config
        self.model, self.vae = loaded.model, loaded.vae
        # under tensor parallelism this rank caches only its own KV heads
        self.kv_stacks = tuple(local_kv_stack(s, tp_size(self.model))
                               for s in (self.config.lm, self.config.residual_lm))
        param = next(self.model.parameters())
        self.device, self.dtype = param.device, param.dtype
        if cfg.vae_dtype != "float32":  # the decoder only: prompt audio is encoded by the float32 encoder
            self.vae.decoder.to(getattr(torch, cfg.vae_dtype))
        self.block_size = cfg.block_size
        self.timesteps = cfg.inference_timesteps
        self.max_timesteps = cfg.max_timesteps or cfg.inference_timesteps
        # every served timesteps value's Euler evaluations: each step runs `schedules.width` of them, each row on its
        # own schedule over one time-embedding table, made here (before any capture) and never reallocated (no LoRA,
        # FP8 or fusion touches the time MLPs' weights)
        self.schedules = self.model.feat_decoder.schedules(range(1, self.max_timesteps + 1))
        with torch.no_grad():
            self.step_table = self.schedules.table(self.model.feat_decoder.estimator, self.device)
        self.max_num_seqs = cfg.max_num_seqs
        cuda = self.device.type == "cuda"
        if cuda:
            self.model.attention = make_attention_backend(self.device, cfg.block_size)
            if FUSED_KERNELS:
                self.model.fuse_projections()  # before the graphs capture the step
        if cfg.fp8_prefill or cfg.fp8_dit:
            self._quantize_fp8(cfg)  # before the memory budget below counts the weights
        weights = torch.cuda.memory_allocated(self.device) if cuda else 0

        self.max_positions = self.config.lm.max_position_embeddings
        p, d = self.config.patch_size, self.config.feat_dim
        self.lora = getattr(self.model, "lora", None) is not None
        self.vae_lane = VaeLane(self.vae, self.device, cfg.max_num_seqs, p, d,
                                lane=cuda and cfg.cuda_graphs and cfg.vae_stream)
        # Rows at more diffusion steps than the default: the step's graphs run the default's evaluations for every
        # row and such rows finish theirs in the step's tail (`engine.step_tail`), which needs the VAE lane (or no
        # graphs) and no LoRA slots; otherwise every step runs the most evaluations served.
        self.graph_evals = self.schedules.width
        self.tail: StepTail | None = None
        if self.max_timesteps > self.timesteps and not self.lora and (
                self.vae_lane.stream is not None or not (cuda and cfg.cuda_graphs)):
            self.graph_evals = evaluations(self.timesteps)
            self.tail = StepTail(self)
        self.host = Staging(self.config, self.device, cfg.max_num_seqs, block_size=self.block_size,
                            max_positions=self.max_positions, schedules=self.schedules, timesteps=self.timesteps,
                            # graph buckets on CUDA; on CPU the decode body runs at the exact batch size (padding
                            # buys nothing there)
                            buckets=buckets_for(cfg.max_num_seqs) if cuda else None, lane=self.vae_lane,
                            lora=self.lora, tail=self.tail)
        self.inputs, self.lora_rows = self.host.inputs, self.host.lora_rows  # the static rows the graphs read
        rows = torch.arange(cfg.max_num_seqs + 1, device=self.device)
        self.row_index, self.cu_seqlens = rows[:-1], rows.to(torch.int32)
        self.zeros, self.ones = torch.zeros_like(self.row_index), torch.ones_like(self.row_index)
        hidden = self.config.lm.hidden_size  # the sample graphs' inputs: LM states of the emitting rows
        self.lm_h = torch.zeros(cfg.max_num_seqs, hidden, device=self.device, dtype=self.dtype)
        self.res_h = torch.zeros_like(self.lm_h)
        self.merged_steps = 0  # steps that ran one adapter merged into the weights (`MergedAdapter`)
        self.eager = EagerStep(self.model, self.vae_lane, self._forward_lms, patch_size=p, feat_dim=d, lora=self.lora)

        self.budget = MemoryBudget(self.model, self.kv_stacks, self.block_size, self.config)
        self.memory = self.budget.memory
        if cfg.num_kv_blocks:
            self.num_blocks = cfg.num_kv_blocks
        elif cuda:
            run = Activations(self._install_caches, lambda: self.host.pad_all(cfg.max_num_seqs),
                              lambda: self._decode_body(cfg.max_num_seqs, self.max_positions), self.vae_lane)
            graph_sets = 1 + self.lora + (self.tail is not None)
            self.num_blocks = agree_min(self.model, self.budget.blocks(cfg, weights, run, graph_sets), self.device)
        else:
            self.num_blocks = CPU_KV_BLOCKS
        self.host.scratch_block = self.num_blocks  # one block past the scheduler's: padding rows write their KV here
        self.caches = tuple(KVCache.allocate(stack, self.num_blocks + 1, self.block_size, self.device, self.dtype)
                            for stack in self.kv_stacks)
        self.graphs: StepGraphs | None = None
        self.sample_graphs: StepGraphs | None = None
        self.lm_graphs: StepGraphs | None = None
        self.adapter_free_graphs: GraphSets | None = None  # with LoRA slots: the three sets captured without LoRA
        self.ahead_tokens = 0  # positions a step launched ahead may hold (its flat batch must take it)
        if cuda or cfg.mixed_ahead(cuda):  # on CPU the flat batch serves only steps launched ahead (no padding gain)
            # the padding sequence (at most 1/8 of a bucket) must fit one sequence's positions
            self.ahead_tokens = min(cfg.max_num_batched_tokens, self.max_positions)
            eager = eager_flat_key(self.ahead_tokens, cfg.max_num_seqs)
            keys: list[tuple[int, ...]] = []
            if cuda and cfg.cuda_graphs:
                # large graphs: LocEnc on no rows, or on as many as a step has sequences (decode rows, short audio)
                keys = [*lm_graph_keys(cfg.max_num_seqs),
                        *large_lm_graph_keys(self.ahead_tokens, eager[1], -(-cfg.max_num_seqs // 64) * 64)]
            self.host.allocate_flat(keys, eager)
        if cuda and cfg.cuda_graphs:
            before = torch.cuda.memory_reserved(self.device)
            pool = torch.cuda.graph_pool_handle()
            with torch.inference_mode():
                self.graphs, self.sample_graphs, self.lm_graphs = self._capture_graphs(pool)
                if self.lora:  # steps whose rows all use no adapter replay these and launch no LoRA kernel
                    self.model.lora.bypass = True
                    try:
                        self.adapter_free_graphs = self._capture_graphs(pool)
                    finally:
                        self.model.lora.bypass = False
                    if self.model.lora.merged is not None:  # an adapter switch: one replay, not ~200 launches
                        self.model.lora.merged.capture()
                if self.tail is not None:
                    self.tail.capture(pool)
                if self.vae_lane.stream is not None:
                    self.vae_lane.capture(self.buckets or [])
            self.memory["graphs_gib"] = (torch.cuda.memory_reserved(self.device) - before) / GiB
        if cuda:
            self.warm_up()
            self.budget.log(cfg, weights, self.num_blocks)
        self.last_step: StepTiming | None = None

    def _install_caches(self, caches: tuple[KVCache, ...] | None) -> None:
        """Scratch KV caches for the memory budget's measurements (their block 0 as the scratch block); None: gone."""
        self.caches, self.host.scratch_block = caches or (), 0

    @property
    def staging(self) -> HostStaging:
        """Where the step being launched is staged (`Staging`)."""
        return self.host.staging

    @property
    def buckets(self) -> list[int] | None:
        """Row buckets of the decode graphs on CUDA (`Staging` pads each step to one); None: the exact batch."""
        return self.host.buckets

    @buckets.setter
    def buckets(self, buckets: list[int] | None) -> None:
        self.host.buckets = buckets

    @property
    def scratch_block(self) -> int:
        """The KV block past the scheduler's that padding rows write into."""
        return self.host.scratch_block

    @property
    def lm_keys(self) -> list[tuple[int, ...]]:
        """The LM graphs' buckets (`Staging.allocate_flat`)."""
        return self.host.lm_keys

    def _capture_graphs(self, pool: tuple) -> GraphSets:
        """Decode, sample and LM graphs for every bucket (the caller sets whether LoRA work is captured)."""
        return (StepGraphs(lambda rows: self._decode_body(rows, self.max_positions), self.buckets or [],
                           self.host.pad_all, pool),
                StepGraphs(self._sample_body, self.buckets or [], self.host.pad_all, pool),
                StepGraphs(self.lm_body, self.lm_keys, self.host.pad_flat, pool))

    def _graph_sets(self) -> tuple[StepGraphs | None, StepGraphs | None, StepGraphs | None]:
        """(decode, sample, LM) graphs for the step being launched: the adapter-free ones when it bypasses LoRA."""
        if self.adapter_free_graphs is not None and self.model.lora.bypass:
            return self.adapter_free_graphs
        return self.graphs, self.sample_graphs, self.lm_graphs

    def _quantize_fp8(self, cfg: WorkerConfig) -> None:
        """FP8 copies of the weights `fp8_prefill` / `fp8_dit` name (`engine.model.fp8`), their kernels warmed up."""
        if not fp8.supported(self.device):
            raise ValueError(f"FP8 GEMMs need a GPU of compute capability 8.9 or newer; {self.device} is "
                             f"{'.'.join(map(str, torch.cuda.get_device_capability(self.device)))}")
        if cfg.fp8_prefill:
            self.model.quantize_lms_fp8()
        if cfg.fp8_dit:
            self.model.quantize_dit_fp8()
        copies = fp8.weights(self.model)
        log.info("FP8 GEMMs from %d rows on in %s: %d FP8 weights, %.2f GiB", fp8.MIN_ROWS,
                 " and ".join(n for n, on in (("the LMs", cfg.fp8_prefill), ("the LocDiT", cfg.fp8_dit)) if on),
                 len(copies), sum(w.weight.numel() + 4 * w.scale.numel() for w in copies) / GiB)
        fp8.warm_up(self.model, cfg.max_num_batched_tokens)

    def step(self, seqs: list[ScheduledSeq]) -> StepOutput:
        """Run one step to completion."""
        return self.collect(self.launch(seqs))

    def warm_up(self) -> None:
        """Compile every kernel specialization a serving step can reach (`WarmUp`)."""
        def flat_step(key: tuple[int, int]) -> None:
            self.host.pad_flat(key)
            self.lm_body(key, eager=True)

        WarmUp(self.model, self.vae_lane, self.caches, self.schedules, self.config, self.block_size, self.scratch_block,
               self.max_positions, self.timesteps, self.lora, self.host.eager_flat[0] if self.host.eager_flat else None,
               flat_step).run()

    def _eager_step(self, seqs: list[ScheduledSeq]) -> StepOutput:
        """The step op by op (`EagerStep`): the reference for the graphed paths."""
        return self.eager(seqs)

    @torch.inference_mode()
    def launch(self, seqs: list[ScheduledSeq], after: PendingStep | None = None, adapter: int = 0) -> PendingStep:
        """Start a step; on the graph paths the device works on it after this returns.

        `after`: a step not yet collected whose sampling requests this step continues, one decode position each
        (`Scheduler.schedule_ahead`; it may also admit new prompts, `admits_ahead`). Its sampled patches become
        this step's inputs on the device, so this step is staged and queued while that one runs, and the device
        never waits for the host between the two.
        `adapter`: the LoRA slot that every running request uses (`Scheduler.single_adapter`; 0: none, or several).
        With a `MergedAdapter` such a step runs that adapter merged into the weights, without LoRA kernels."""
        start = None
        if self.device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            start.record()
        pending = self._launch(seqs, after, adapter)
        if start is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            pending.events = (start, end)
        return pending

    def _launch(self, seqs: list[ScheduledSeq], after: PendingStep | None, adapter: int) -> PendingStep:
        self.host.next_host()
        if not self.lora:
            return self._launch_step(seqs, after)
        # a step without adapter rows skips all LoRA work: eagerly by the flag, graphed by the sets captured with it;
        # so does one whose adapter is merged into the weights (every running request uses it, so all its rows do)
        state = self.model.lora
        merged = state.merged is not None and adapter != 0 and all(s.request.lora_slot == adapter for s in seqs)
        if state.merged is not None:
            state.merged.use(adapter if merged else 0)
        state.bypass = merged or all(s.request.lora_slot == 0 for s in seqs)
        self.merged_steps += merged
        if merged:
            how = f"merged {adapter}"
        elif state.bypass:
            how = "bypass"
        elif log.isEnabledFor(logging.DEBUG):  # each row's slot only then: a join over the batch every step otherwise
            how = "kernels " + ",".join(str(s.request.lora_slot) for s in seqs)
        else:
            how = "kernels"
        try:
            pending = self._launch_step(seqs, after)
        finally:
            self.model.lora.bypass = False
        pending.lora = how
        return pending

    def _launch_step(self, seqs: list[ScheduledSeq], after: PendingStep | None) -> PendingStep:
        decode_graphs, sample_graphs, _ = self._graph_sets()
        if self.tail is not None:
            self.tail.bucket = 0  # `Staging.stage_rows` stages this step's tail, if it has one
        # the seqs that continue `after` (still on the device): seq k's input patch is row fed[k] of its samples
        fed = fed_rows(seqs, after) if after is not None else {}
        if self._decode_only(seqs):
            n = len(seqs)
            # rows continuing `after` get their input on the device; the others (split decodes: the other half,
            # collected a step ago) from the host
            conds = [None if k in fed else s.request.generated[-1] for k, s in enumerate(seqs)]
            rows = self.host.stage_rows([s.request for s in seqs], conds)
            self.host.stage_positions(seqs)
            self.host.upload(rows)
            if fed:
                ks = sorted(fed)
                self.host.gather(self.inputs.patches, ks, after, [fed[k] for k in ks])
            if decode_graphs is not None:
                result = self.vae_lane.audio(rows, self._replay_tail(decode_graphs.replay(rows)), self.inputs.vae_slots)
            else:
                result = self._decode_body(rows, self._max_seqlen_k(n), eager_tail=True)
            pending = self.host.download(seqs, result, n, None)
            pending.kind = "graph" if decode_graphs is not None else "decode"
            pending.sampled = result.patches
            return pending
        emit = [k for k, s in enumerate(seqs) if s.emit]
        rows = n = 0
        if emit:  # the sampling inputs first: the LM graph may reuse the memory `after` sampled into
            reqs = [seqs[k].request for k in emit]
            rows = self.host.stage_rows(reqs, [None if k in fed else seqs[k].request.cond for k in emit])
            self.host.upload(rows)
            conds = [j for j, k in enumerate(emit) if k in fed]
            if conds:
                self.host.gather(self.inputs.patches, conds, after, [fed[emit[j]] for j in conds])
        lm_h, res_h = self._forward_lms(seqs, after, fed)
        if not emit:
            return PendingStep(seqs, done=StepOutput([None] * len(seqs), [False] * len(seqs), [None] * len(seqs)),
                               kind="mixed")
        index = self.host.index(emit)
        n = len(emit)
        self.lm_h[:n].copy_(lm_h.index_select(0, index))
        self.res_h[:n].copy_(res_h.index_select(0, index))
        self.lm_h[n:rows].zero_()
        self.res_h[n:rows].zero_()
        if sample_graphs is not None:
            result = self.vae_lane.audio(rows, self._replay_tail(sample_graphs.replay(rows)), self.inputs.vae_slots)
        else:
            result = self._sample_body(rows, eager_tail=True)
        pending = self.host.download(seqs, result, n, emit)
        pending.kind = "mixed"
        pending.sampled = result.patches
        return pending

    @property
    def admits_ahead(self) -> bool:
        """Whether a step launched ahead (`launch(after=...)`) may admit prompts: they go through the flat buffers
        (where the continuing rows' patches are fed on the device)."""
        return self.host.eager_flat is not None

    def collect(self, pending: PendingStep) -> StepOutput:
        """Wait for a launched step's outputs (and note its timing in `last_step`)."""
        out = self._collect(pending)
        gpu_ms = audio_ms = None
        if pending.events is not None:
            pending.events[1].synchronize()
            gpu_ms = pending.events[0].elapsed_time(pending.events[1])
            if pending.audio_event is not None:
                audio_ms = pending.events[0].elapsed_time(pending.audio_event)
        prefill = sum(s.num_tokens for s in pending.seqs if s.num_tokens > 1 or not s.request.generated)
        decode = sum(1 for s in pending.seqs if s.num_tokens == 1 and s.request.generated)
        self.last_step = StepTiming(pending.kind, prefill, decode, gpu_ms, audio_ms, pending.lora)
        return out

    def _collect(self, pending: PendingStep) -> StepOutput:
        if pending.done is not None:
            return pending.done
        assert pending.result is not None
        for event in (pending.event, pending.audio_event):
            if event is not None:
                event.synchronize()
        r = pending.result
        patches = list(r.patches.clone())  # the requests keep these; the pinned buffers are reused
        stops = r.stops.tolist()
        audio = r.audio.numpy()
        if pending.emit is None:
            return StepOutput(patches, stops, [audio[j] for j in range(len(pending.seqs))])
        out = StepOutput([None] * len(pending.seqs), [False] * len(pending.seqs), [None] * len(pending.seqs))
        for j, k in enumerate(pending.emit):
            out.patches[k], out.stops[k], out.audio[k] = patches[j], stops[j], audio[j]
        return out

    def _decode_only(self, seqs: list[ScheduledSeq]) -> bool:
        width = self.staging.buffers.block_tables.shape[1]
        return bool(seqs) and len(seqs) <= self.max_num_seqs and all(
            s.num_tokens == 1 and s.emit and s.request.generated and len(s.request.block_table) <= width
            for s in seqs)

    def _max_seqlen_k(self, n: int) -> int:
        # CUDA: a fixed bound, so one graph serves every length; CPU (TorchAttention pads to it): the real one
        return self.max_positions if self.device.type == "cuda" else int(self.staging.buffers.seq_lens[:n].max())

    def _decode_body(self, rows: int, max_seqlen_k: int, eager_tail: bool = False) -> DecodeResult:
        """The whole decode step over the first `rows` rows of the static buffers (what the graphs capture);
        `eager_tail`: see `_sample_body`."""
        b = self.inputs
        self.model.set_lora_indices(tokens=self.lora_rows[:rows])
        meta = AttentionMetadata(cu_seqlens_q=self.cu_seqlens[:rows + 1], seq_lens=b.seq_lens[:rows],
                                 slot_mapping=b.slots[:rows], block_tables=b.block_tables[:rows],
                                 max_seqlen_q=1, max_seqlen_k=max_seqlen_k)
        lm_h, res_h = self.model.forward_lms(self.zeros[:rows], b.patches[:rows].to(self.dtype), self.ones[:rows],
                                             b.positions[:rows], meta, self.caches, last_index=self.row_index[:rows])
        return self._sample_body(rows, lm_h, res_h, eager_tail)

    def _sample_body(self, rows: int, lm_h: torch.Tensor | None = None, res_h: torch.Tensor | None = None,
                     eager_tail: bool = False) -> DecodeResult:
        """Sample + stop + VAE for the first `rows` rows (LM states from `lm_h`/`res_h`, default: the static ones),
        the graphs' evaluations of each row's schedule. With the VAE lane, no VAE (audio None): `VaeLane.audio` queues
        it on its own stream. `eager_tail` (eager callers; graphs replay the tail after this): run the staged step's
        tail (`engine.step_tail`) before the VAE decodes its rows."""
        b = self.inputs
        self.model.set_lora_indices(seqs=self.lora_rows[:rows])
        given = (lm_h, res_h)
        lm_h = self.lm_h[:rows] if lm_h is None else lm_h
        res_h = self.res_h[:rows] if res_h is None else res_h
        evals = self.graph_evals
        steps = RowSteps(self.step_table, b.steps_index[:rows, :evals], b.steps_dt[:rows, :evals])
        sampled = self.model.sample_patches(lm_h, res_h, b.patches[:rows].to(self.dtype),
                                            b.noise[:rows].to(self.dtype), steps, b.cfg[:rows].to(self.dtype))
        stops = self.model.stop_flags(lm_h)
        if self.tail is not None:
            sampled = self.tail.keep(rows, sampled, *given)
            if eager_tail and self.tail.bucket:
                self.tail.body(self.tail.bucket)
        if self.vae_lane.stream is not None:
            return DecodeResult(sampled, stops, None)
        return DecodeResult(sampled, stops, self.vae_lane.decode(b.vae_slots[:rows], sampled))

    def _replay_tail(self, result: DecodeResult) -> DecodeResult:
        """`result` (a graph's) once the staged step's tail, if any, has finished its rows in place."""
        if self.tail is not None:
            self.tail.replay()
        return result

    def lm_body(self, key: tuple[int, ...], eager: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Both LMs over the staged flat buffers of bucket `key` (what an LM graph captures); (lm_h, res_h) [S, H]
        with row j the state of scheduled sequence j (rows past the real sequences are padding). LocEnc runs on
        every row of a small graph's bucket, on the listed audio rows of a large one's (tokens, seqs, audio).

        `eager` (not captured): the attention grid and KV splits from the staged batch's real lengths, and LocEnc
        on its audio rows only (padded to a multiple of 64 with a repeat, so their GEMM shapes recur too)."""
        tokens, seqs = key[:2]
        f = self.host.flat
        if self.lora:
            self.model.set_lora_indices(tokens=f.lora[:tokens])
        max_q, max_k, audio_rows = tokens, self.max_positions, None
        query_rows = None
        if len(key) > 2:
            audio_rows = f.audio_rows[:key[2]]
            # the attention's query tile (its heuristic reads the batch shape, which a graph bucket of mostly empty
            # sequences misstates): large for prompts alone, small beside decode rows (audio rows), whose programs
            # would compute whole tiles for one query each (`TritonAttention.rows_for`)
            query_rows = PREFILL_ROWS[-1] if key[2] else PREFILL_ROWS[0]
        if eager or self.device.type != "cuda":
            h = self.host.flat_np
            max_q, max_k = int(np.diff(h["cu_seqlens"][:seqs + 1]).max()), int(h["seq_lens"][:seqs].max())
        if eager:
            audio = np.flatnonzero(h["masks"][:tokens])
            if len(audio):
                audio = np.concatenate((audio, np.full(-len(audio) % 64, audio[0])))
            audio_rows = self.host.index(audio)
        meta = AttentionMetadata(cu_seqlens_q=f.cu_seqlens[:seqs + 1], seq_lens=f.seq_lens[:seqs],
                                 slot_mapping=f.slots[:tokens], block_tables=f.block_tables[:seqs],
                                 max_seqlen_q=max_q, max_seqlen_k=max_k, query_rows=query_rows)
        return self.model.forward_lms(f.ids[:tokens], f.patches[:tokens].to(self.dtype), f.masks[:tokens],
                                      f.positions[:tokens], meta, self.caches, last_index=f.last_index[:seqs],
                                      audio_rows=audio_rows)

    def _forward_lms(self, seqs: list[ScheduledSeq], after: PendingStep | None = None,
                     fed: dict[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Both LMs over the flat batch of every scheduled chunk: an LM graph replay when a bucket holds it, else
        eagerly over the padded flat buffers, else (larger than those) unpadded; (lm_h, res_h) with row j the state
        of seqs[j] (at least len(seqs) rows). `fed` (`fed_rows`): seqs whose input patch `after` sampled."""
        if self.lm_keys or self.host.eager_flat:  # CUDA (and CPU with async_mixed, or when a test allocates them)
            key = self.host.stage_flat(seqs, fed or {})
            if key is not None:
                self.host.upload_flat(key)
                if fed:
                    assert after is not None
                    first = np.cumsum([0] + [s.num_tokens for s in seqs])
                    self.host.gather(self.host.flat.patches, [int(first[k]) for k in fed], after, list(fed.values()))
                lm_graphs = self._graph_sets()[2]
                if lm_graphs is not None and key in lm_graphs.graphs:
                    return lm_graphs.replay(key)
                return self.lm_body(key, eager=key not in self.lm_keys)
        if fed:
            raise ValueError(f"a step launched ahead must fit the flat buffers (up to {self.host.eager_flat})")
        ids: list[int] = []
        masks: list[int] = []
        patches: list[torch.Tensor] = []
        positions: list[int] = []
        for seq in seqs:
            i, p, m = seq.request.inputs(seq.start, seq.start + seq.num_tokens)
            ids += i
            masks += m
            patches.append(p)
            positions.extend(range(seq.start, seq.start + seq.num_tokens))
        query_lens = [s.num_tokens for s in seqs]
        meta = AttentionMetadata.build(query_lens, [s.start for s in seqs],
                                       [s.request.block_table for s in seqs], self.block_size, self.device)
        dev = self.device
        if self.lora:
            slots = [s.request.lora_slot for s in seqs]
            self.model.set_lora_indices(tokens=torch.tensor(np.repeat(slots, query_lens), device=dev))
        last_index = torch.tensor(np.cumsum(query_lens) - 1, device=dev)
        # prefill is mostly text: LocEnc only where there is audio
        audio_rows = torch.tensor(np.flatnonzero(masks), dtype=torch.long, device=dev)
        lm_h, res_h = self.model.forward_lms(
            torch.tensor(ids, device=dev), torch.cat(patches).to(dev, self.dtype), torch.tensor(masks, device=dev),
            torch.tensor(positions, device=dev), meta, caches=self.caches, last_index=last_index,
            audio_rows=audio_rows)
        return lm_h, res_h
