"""The tail of a step: rows at more diffusion steps than the default finish their Euler evaluations after it.

A step's graphs run the default timesteps' LocDiT evaluations for every row (rows with fewer ride along:
`engine.model.euler`). A row above the default continues from the state the step left in `out` through the rest of
its own schedule, in a graph per row bucket over just those rows (gathered by index; padding rows write a scratch
row past the bucket), replayed after the step's graph and before the VAE lane decodes the patches. The step's other
rows wait for that tail (the cost of a batch-mate's settings) and pay next to nothing without one: the step copies
its patches and LM states into the static rows the tail reads.

It needs the patches to be decoded after the step's graph, so the runner keeps it only with the VAE lane or
without graphs (eagerly, the tail runs inside the sample body before the VAE); it has no LoRA slot plumbing, so
not with LoRA slots either. Otherwise every step runs the most evaluations served.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.cuda_graphs import StepGraphs, bucket_for
from engine.model.euler import RowSteps

if TYPE_CHECKING:
    from engine.runner import Runner


class StepTail:
    """The tail of `runner`'s steps: `stage` it with the step's sampling rows, `keep` the step's outputs where it
    reads them, then `replay` it after the step's graph (or, eagerly, `body`)."""

    def __init__(self, runner: Runner):
        self.runner = runner
        rows, p, d = runner.max_num_seqs, runner.config.patch_size, runner.config.feat_dim
        self.out = torch.zeros(rows + 1, p, d, device=runner.device)  # the step's patches; row `rows`: scratch
        self.scratch = rows
        self.bucket = 0  # the staged step's tail (its row bucket), 0: none
        self.graphs: StepGraphs | None = None

    def capture(self, pool: tuple) -> None:
        """One graph per row bucket (in the runner's graph pool: replayed in turn with its other graphs)."""
        self.graphs = StepGraphs(self.body, self.runner.buckets or [], self.pad, pool)

    def stage(self, timesteps: np.ndarray) -> None:
        """Host rows of the tail's gather for a step whose sampling rows sample at `timesteps`: the rows with more
        evaluations than the graphs', padded to their bucket (the padding reads row 0, writes the scratch row)."""
        r = self.runner
        tail = np.flatnonzero(r.schedules.evaluations_by_value[timesteps] > r.graph_evals)
        self.bucket = 0
        if len(tail):
            h, k = r.staging.arrays, len(tail)
            self.bucket = bucket_for(k, r.buckets) if r.buckets else k
            h["tail_src"][:k] = h["tail_dst"][:k] = tail
            h["tail_src"][k:self.bucket] = 0
            h["tail_dst"][k:self.bucket] = self.scratch

    def keep(self, rows: int, sampled: torch.Tensor, lm_h: torch.Tensor | None, res_h: torch.Tensor | None
             ) -> torch.Tensor:
        """Inside the sample body: the step's patches into `out` (returned: the step's outputs) and its LM states
        into the runner's static rows (None: they are there already), where the tail reads them."""
        r = self.runner
        if lm_h is not None and res_h is not None:
            r.lm_h[:rows].copy_(lm_h)
            r.res_h[:rows].copy_(res_h)
        self.out[:rows].copy_(sampled)
        return self.out[:rows]

    def body(self, k: int) -> None:
        """The evaluations past the graphs' own of the `k` staged rows, continued from their state in `out` and
        written back there (what the tail graphs capture)."""
        r = self.runner
        b, evals = r.inputs, r.graph_evals
        src = b.tail_src[:k]
        steps = RowSteps(r.step_table, b.steps_index.index_select(0, src)[:, evals:],
                         b.steps_dt.index_select(0, src)[:, evals:])
        x = r.model.continue_patches(r.lm_h.index_select(0, src), r.res_h.index_select(0, src),
                                     b.patches.index_select(0, src).to(r.dtype), self.out.index_select(0, src),
                                     steps, b.cfg.index_select(0, src))
        self.out.index_copy_(0, b.tail_dst[:k], x)

    def replay(self) -> None:
        """The staged tail after the step's graph (its patches are `out`'s rows, finished in place)."""
        if self.bucket:
            assert self.graphs is not None
            self.graphs.replay(self.bucket)

    def pad(self, k: int) -> None:
        """Stage and upload `k` tail rows of padding (graph capture)."""
        r = self.runner
        r.staging.writable()
        r.host.stage_padding(k)
        h = r.staging.arrays
        h["tail_src"][:k] = 0
        h["tail_dst"][:k] = self.scratch
        r.host.upload(k)
