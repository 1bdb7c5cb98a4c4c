"""Batched multi-adapter LoRA: many adapters (and none) in one forward, Punica/S-LoRA style.

`attach_lora` gives every LoRA-capable linear of a VoxCPMModel stacked slot weights A [S, r_max, in] and
B [S, out, r_max] (ranks zero-padded to r_max, alpha/r folded into B; slot 0 is all zeros = no adapter) and a
forward hook adding `B[slot] (A[slot] x)` row by row. The linear itself is untouched (it may be any module with
in/out features, e.g. a tensor-parallel one), and the slot tensors are non-persistent buffers: state_dict names stay
the official ones and a model without `attach_lora` pays nothing.

Which slot a row uses comes from index tensors set once per step with `VoxCPMModel.set_lora_indices`:
- `tokens` [N]: one per flat LM position (both LMs' q/k/v/o, enc_to_lm_proj, fusion_concat_proj);
- `seqs` [B]: one per sampled sequence (lm_to_dit_proj, res_to_dit_proj);
- the LocDiT rows [2B] (CFG runs conditional then unconditional rows) are `cat(seqs, seqs)`, made in
  `sample_patches` so a CUDA graph captures it.
The hooks read whatever tensors are set, so a graph that captured static index buffers replays with new slots.

Linears sharing their input (q/k/v, gate/up) get one `FusedLoRA` whose stacked A/B their slot buffers are views of:
the model keeps running them as one fused GEMM (`fused_linear`) and adds all their deltas with one shrink and one
expand. On CUDA the Triton kernels group rows by slot once per step (`LoRAState.segments`) and skip slot-0 rows;
`LoRAState.bypass` skips all LoRA work for a step the host knows to be adapter-free.

When every running request uses the same adapter (one voice, or one stream), the worker runs its steps with that
adapter merged into the base weights instead (`MergedAdapter`): the base model's kernels and graphs, no LoRA work.

Targets follow the official `_apply_lora`: q/k/v/o (configurable names) of base_lm + residual_lm ("lm") and of the
LocDiT ("dit"), and the projections ("proj"); never the LocEnc.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from engine.model.fusion import fused

LM_STACKS = ("base_lm", "residual_lm")
DIT_STACK = "feat_decoder.estimator.decoder"
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
# linears sharing their input, which the model may run as one GEMM (engine.model.layers.fused_linear)
FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
GROUP_ROWS_PER_SLOT = 8  # CPU `lora_delta_add`: from this many rows per slot on, rows are taken slot by slot
PROJ_TARGETS = {"enc_to_lm_proj": "tokens", "fusion_concat_proj": "tokens",
                "lm_to_dit_proj": "seqs", "res_to_dit_proj": "seqs"}


class LoRAState:
    """Shared by every LoRA layer of one model: the slot layers by module path and this step's row slots."""

    def __init__(self, num_slots: int, max_rank: int):
        self.num_slots = num_slots  # including slot 0 (no adapter)
        self.max_rank = max_rank
        self.layers: dict[str, LoRALayer] = {}
        # True: every LoRA layer passes its linear's output through untouched, for a step whose rows all use slot
        # 0 (the host knows; a runner with CUDA graphs captures one set per value and replays the matching one)
        self.bypass = False
        self.versions = [0] * num_slots  # bumped when a slot's weights change: a merge of it is stale then
        self.merged: MergedAdapter | None = None  # `merge_into_weights`
        self._rows: dict[str, Tensor | None] = {"tokens": None, "seqs": None, "dit": None}
        self._segments: dict[tuple[str, int], Any] = {}

    def _set(self, group: str, index: Tensor | None) -> None:
        self._rows[group] = index
        self._segments = {key: seg for key, seg in self._segments.items() if key[0] != group}

    tokens = property(lambda self: self._rows["tokens"], lambda self, index: self._set("tokens", index))
    seqs = property(lambda self: self._rows["seqs"], lambda self, index: self._set("seqs", index))
    dit = property(lambda self: self._rows["dit"], lambda self, index: self._set("dit", index))

    def rows(self, group: str) -> Tensor | None:
        return self._rows[group]

    def segments(self, group: str, rows_per_index: int) -> Any:
        """The group's rows sorted into slot segments for the Triton kernels: once per step, shared by its linears
        (recomputed after the group's indices are set again, also inside a CUDA graph capture)."""
        key = (group, rows_per_index)
        if key not in self._segments:
            from engine.model.lora_triton import segment_rows

            self._segments[key] = segment_rows(self._rows[group], rows_per_index, self.num_slots)
        return self._segments[key]

    def begin_sampling(self) -> None:
        """The LocDiT's row slots for this step's 2B CFG rows."""
        self.dit = None if self.seqs is None else torch.cat((self.seqs, self.seqs))

    @torch.no_grad()
    def load_slot(self, slot: int, weights: dict[str, tuple[Tensor, Tensor]]) -> None:
        """Fill `slot` from {module path: (A [r_max, in], B [out, r_max] scaled)}; layers not named are zeroed."""
        if not 1 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} out of range 1..{self.num_slots - 1}")
        unknown = set(weights) - set(self.layers)
        if unknown:
            raise ValueError(f"no LoRA layer named {sorted(unknown)[0]!r}")
        self.versions[slot] += 1
        for path, layer in self.layers.items():
            if path in weights:
                a, b = weights[path]
                layer.lora_A[slot].copy_(a, non_blocking=True)
                layer.lora_B[slot].copy_(b, non_blocking=True)
            else:
                layer.lora_A[slot].zero_()
                layer.lora_B[slot].zero_()

    def clear_slot(self, slot: int) -> None:
        self.load_slot(slot, {})


class MergedAdapter:
    """One adapter merged into the base weights, for steps whose rows all use it: those run the base model's
    kernels (and its adapter-free CUDA graphs) with no LoRA work, so a single voice costs what the base model costs.
    The adapted linears' own weights are kept (one device copy, ~0.8 GB for VoxCPM2) and copied back, never
    subtracted, so switching adapters never drifts the base model. Merging and restoring are ordinary kernels on the
    step's stream: a step still on the device reads the weights it was launched with.

    On CUDA `capture` records each slot's merge (and the restore) as one graph: a switch is then one replay, ~1 ms of
    memory traffic, where the ~200 launches from Python took ~4 ms of host time inside the new request's TTFB."""

    def __init__(self, state: LoRAState, model: nn.Module):
        self.state = state
        self.linears = {path: model.get_submodule(path) for path in state.layers}
        self.original = {path: m.weight.detach().clone() for path, m in self.linears.items()}
        self.slot, self.version = 0, 0  # what the weights carry now (slot 0: the originals)
        self.graphs: list[torch.cuda.CUDAGraph] = []  # by slot (`capture`)

    @torch.no_grad()
    def use(self, slot: int) -> None:
        """Make the weights carry slot `slot`'s adapter, W + B A (B holds alpha/r), or the original weights for slot
        0; nothing to do when they already do. A slot's graph reads the slot's buffers in place, so it serves
        whatever the slot holds now."""
        version = self.state.versions[slot] if slot else 0
        if (slot, version) == (self.slot, self.version):
            return
        if self.graphs:
            self.graphs[slot].replay()
        else:
            self._write(slot)
        self.slot, self.version = slot, version

    def _write(self, slot: int) -> None:
        """The weights of slot `slot`: one GEMM per linear, accumulated in fp32 with W added in its epilogue and
        rounded once (slot 0: a copy of each original)."""
        for path, linear in self.linears.items():
            if slot:
                layer = self.state.layers[path]
                torch.addmm(self.original[path], layer.lora_B[slot], layer.lora_A[slot], out=linear.weight)
            else:
                linear.weight.copy_(self.original[path])

    @torch.no_grad()
    def capture(self) -> None:
        """Record `_write` of every slot as a CUDA graph (no memory of their own: every kernel writes in place).
        Captured with capture_begin/end on a side stream rather than `torch.cuda.graph`, which collects garbage and
        empties the cache before each of what may be hundreds of captures."""
        device = next(iter(self.original.values())).device
        self._write(1)  # cuBLAS' handle and workspace exist before a capture (slot 1 always exists: attach_lora)
        self._write(0)
        self.slot, self.version = 0, 0  # the originals again, whatever `use` had merged before
        stream, pool = torch.cuda.Stream(device), torch.cuda.graph_pool_handle()
        stream.wait_stream(torch.cuda.current_stream(device))
        graphs = []
        with torch.cuda.stream(stream):
            for slot in range(self.state.num_slots):
                graph = torch.cuda.CUDAGraph()
                graph.capture_begin(pool=pool)
                self._write(slot)
                graph.capture_end()
                graphs.append(graph)
        torch.cuda.current_stream(device).wait_stream(stream)
        self.graphs = graphs


def merge_into_weights(state: LoRAState, model: nn.Module) -> MergedAdapter:
    """Let steps whose rows all use one adapter run it merged into the weights (`MergedAdapter`)."""
    state.merged = MergedAdapter(state, model)
    return state.merged


class LoRALayer(nn.Module):
    """The slot weights of one linear and the batched delta it adds to the linear's output."""

    def __init__(self, in_features: int, out_features: int, state: LoRAState, group: str,
                 device: torch.device, dtype: torch.dtype, views: tuple[Tensor, Tensor] | None = None):
        super().__init__()
        self.state, self.group = state, group
        r, s = state.max_rank, state.num_slots
        a, b = views or (torch.zeros(s, r, in_features, device=device, dtype=dtype),
                         torch.zeros(s, out_features, r, device=device, dtype=dtype))
        self.register_buffer("lora_A", a, persistent=False)
        self.register_buffer("lora_B", b, persistent=False)

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        return apply_lora(self.state, self.group, x, y, self.lora_A, self.lora_B)


class FusedLoRA:
    """The LoRAs of linears sharing their input (q/k/v, gate/up) as one: A's stacked [S, n * r, in], B's
    [S, sum(out), r]. The members' slot buffers are views of these (so `load_slot` fills both) and their hooks still
    serve the unfused path; the fused GEMM's output gets all deltas from one shrink and one expand."""

    def __init__(self, linears: list[nn.Module], state: LoRAState, group: str, device: torch.device,
                 dtype: torch.dtype):
        self.state, self.group = state, group
        self.outs = tuple(m.out_features for m in linears)
        r, s = state.max_rank, state.num_slots
        self.lora_A = torch.zeros(s, r * len(linears), linears[0].in_features, device=device, dtype=dtype)
        self.lora_B = torch.zeros(s, sum(self.outs), r, device=device, dtype=dtype)
        self.members: list[LoRALayer] = []
        start = 0
        for i, m in enumerate(linears):
            views = (self.lora_A[:, i * r:(i + 1) * r], self.lora_B[:, start:start + m.out_features])
            self.members.append(LoRALayer(m.in_features, m.out_features, state, group, device, dtype, views))
            start += m.out_features

    def intact(self) -> bool:
        """Whether the members' buffers still are the views (a `.to()` after `attach_lora` copies them apart)."""
        r, start = self.state.max_rank, 0
        for i, layer in enumerate(self.members):
            if (layer.lora_A.data_ptr() != self.lora_A[:, i * r].data_ptr()
                    or layer.lora_B.data_ptr() != self.lora_B[:, start].data_ptr()):
                return False
            start += layer.lora_B.shape[1]
        return True

    def __call__(self, x: Tensor, y: Tensor) -> Tensor:
        """y (the fused GEMM's output, members' columns in order) plus every member's LoRA of x."""
        return apply_lora(self.state, self.group, x, y, self.lora_A, self.lora_B, self.outs)


def apply_lora(state: LoRAState, group: str, x: Tensor, y: Tensor, lora_a: Tensor, lora_b: Tensor,
               outs: tuple[int, ...] | None = None) -> Tensor:
    """y plus the row group's per-row LoRA of x (see `lora_delta_add`). CUDA: the Triton kernels, in place on y."""
    index = state.rows(group)
    if index is None or state.bypass:  # the base model
        return y
    rows = index.shape[0]
    if x.shape[0] != rows:
        raise ValueError(f"LoRA {group} indices cover {rows} rows, the input has {x.shape[0]}")
    if not fused(y):
        return lora_delta_add(y, x, lora_a, lora_b, index, outs)
    from engine.model.lora_triton import lora_add_

    x2 = x.reshape(-1, x.shape[-1])
    per = x2.shape[0] // max(rows, 1)
    lora_add_(y.view(-1, y.shape[-1]), x2 if x2.stride(-1) == 1 else x2.contiguous(), lora_a, lora_b, index, per,
              outs, state.segments(group, per))
    return y


def lora_delta_add(y: Tensor, x: Tensor, lora_a: Tensor, lora_b: Tensor, index: Tensor,
                   outs: tuple[int, ...] | None = None) -> Tensor:
    """y + per-row LoRA of x with torch ops (the CPU path and the kernels' reference): x [R, ..., in],
    y [R, ..., out]; row r uses slot index[r] of A [S, parts * r, in] and B [S, out, r], where `outs` (default
    (out,)) splits y's columns and B's rows among the parts, part j using A's rank block j.

    Each row gathers its slot's weights (one bmm; no host sync, so a CUDA graph captures it). On CPU, with many more
    rows than slots (a prefill: a prompt's positions share one slot), the rows go slot by slot instead: a bmm of one
    tiny matrix per position cost 2.2 s where the whole step took 0.3 s without LoRA (16 prompts of 335 positions,
    tiny model). Decode rows (a few per slot) keep the gather: slot by slot, their small ops cost more."""
    rows, rank = index.shape[0], lora_b.shape[-1]
    splits = outs or (lora_b.shape[1],)
    x3 = x.reshape(rows, -1, x.shape[-1])

    def delta(xs: Tensor, a: Tensor, b: Tensor) -> Tensor:  # xs [n, L, in], a [n, parts * r, in], b [n, out, r]
        t = torch.bmm(xs, a.transpose(1, 2))
        return torch.cat([torch.bmm(t[..., j * rank:(j + 1) * rank], part.transpose(1, 2))
                          for j, part in enumerate(b.split(splits, dim=1))], dim=-1)

    if index.device.type != "cpu" or rows < GROUP_ROWS_PER_SLOT * lora_a.shape[0]:
        return y + delta(x3, lora_a[index], lora_b[index]).view_as(y)
    out = torch.zeros(*x3.shape[:2], lora_b.shape[1], dtype=torch.promote_types(x.dtype, lora_a.dtype))
    for slot in index.unique().tolist():
        if slot:  # slot 0 holds zeros: its rows add nothing
            sel = (index == slot).nonzero().squeeze(1)
            xs = x3[sel].reshape(1, -1, x3.shape[-1])  # all the slot's rows as one matrix
            out[sel] = delta(xs, lora_a[slot:slot + 1], lora_b[slot:slot + 1]).view(len(sel), x3.shape[1], -1)
    return y + out.view_as(y)


def _add_lora(linear: nn.Module, args: tuple[Tensor, ...], out: Tensor) -> Tensor:
    return linear.lora(args[0], out)


def lora_target_modules(model: nn.Module, lm: tuple[str, ...] = ATTENTION_TARGETS,
                        dit: tuple[str, ...] = ATTENTION_TARGETS, proj: bool = True
                        ) -> dict[str, tuple[nn.Module, str]]:
    """{module path: (linear, row group)} of every LoRA-capable linear (paths as in the official state_dict)."""
    found: dict[str, tuple[nn.Module, str]] = {}
    for stack, names, group in [(s, lm, "tokens") for s in LM_STACKS] + [(DIT_STACK, dit, "dit")]:
        for name, module in model.get_submodule(stack).named_modules():
            if name.rsplit(".", 1)[-1] in names and hasattr(module, "in_features"):
                found[f"{stack}.{name}"] = (module, group)
    if proj:
        for name, group in PROJ_TARGETS.items():
            module = getattr(model, name, None)
            if module is not None:
                found[name] = (module, group)
    return found


def attach_lora(model: nn.Module, num_adapters: int, max_rank: int, lm: tuple[str, ...] = ATTENTION_TARGETS,
                dit: tuple[str, ...] = ATTENTION_TARGETS, proj: bool = True) -> LoRAState:
    """Give `model` `num_adapters` LoRA slots (plus slot 0) of rank up to `max_rank` on its target linears."""
    if num_adapters < 1 or max_rank < 1:
        raise ValueError(f"attach_lora needs num_adapters >= 1 and max_rank >= 1 (got {num_adapters}, {max_rank})")
    if getattr(model, "lora", None) is not None:
        raise ValueError("this model already has LoRA slots")
    param = next(model.parameters())
    state = LoRAState(num_slots=num_adapters + 1, max_rank=max_rank)
    targets = lora_target_modules(model, lm, dit, proj)
    layers: dict[str, LoRALayer] = {}
    for path, (_, group) in targets.items():  # siblings sharing their input first: one FusedLoRA
        parent, _, name = path.rpartition(".")
        for names in FUSED_GROUPS:
            paths = [f"{parent}.{n}" for n in names]
            if name == names[0] and all(p in targets and targets[p][1] == group for p in paths):
                linears = [targets[p][0] for p in paths]
                fused_lora = FusedLoRA(linears, state, group, param.device, param.dtype)
                for p, m, layer in zip(paths, linears, fused_lora.members, strict=True):
                    m.fused_lora, layers[p] = fused_lora, layer
    for path, (linear, group) in targets.items():
        layer = layers.get(path) or LoRALayer(linear.in_features, linear.out_features, state, group, param.device,
                                              param.dtype)
        linear.lora = layer
        linear.register_forward_hook(_add_lora)
        state.layers[path] = layer
    model.lora = state
    return state
