"""DecodeGraphs: one CUDA graph per exact decode batch size B over one (KV pool, State pool),
one per speculative verify shape (N tokens over B rows), and one per MTP draft chain (B rows,
steps) or DFlash block pass (B rows) over a KV pool.

A decode graph replays runner.run over the decode metadata buffer, so its inputs (token ids,
positions, block tables, state slots) are whatever was copied into that buffer before the launch.
A verify graph replays runner.run over the eager metadata buffer with the rows' snapshot bases
(the workspace's snap buffer) and every token's logits and final-normed hidden (the drafter's
feed): the launches of an eager verify of the same N and B whose rows are all shorter than the
tensor-core attention's minimum, so its results are the eager call's, bit for bit.
A graph writes into its pools' arena regions: closing a pool destroys the graphs captured over it
(forget), before the regions go back to the arena.
"""
from __future__ import annotations

import time

from ....core.cuda.graph import Graph


class DecodeGraphs:
    captured = 0        # graphs captured so far ...
    capture_seconds = 0.0   # ... and the seconds it took (CudaModel.one_off_seconds)
    # StepRunner.run's capture hook for the decode graphs (a DFlash drafter's features: each
    # plain step hands them, so a k = 0 unit can be a plain step); None: none
    capture = None

    def __init__(self, stream, runner, meta):
        self._stream, self._runner, self._meta = stream, runner, meta
        # (B, id(kv), id(state)) -> (graph, kv, state): the entry holds the pools, so their ids
        # cannot be reused while it lives
        self._graphs: dict = {}

    def __len__(self) -> int:
        return len(self._graphs)

    def get(self, B: int, kv, state) -> Graph:
        """The decode graph of B rows over (kv, state), captured on first use."""
        runner, meta = self._runner, self._meta

        def run(st):
            runner.run(st, meta, B, B, B, kv, state, capture=self.capture)
        return self._get((B, id(kv), id(state)), kv, state, run)

    def verify(self, n: int, B: int, kv, state, meta, snap, capture=None) -> Graph:
        """The verify graph of n tokens over B rows (eager metadata `meta`, snapshot bases at
        device pointer `snap`), captured on first use: every token's logits and argmax in the
        workspace's logits rows, every token's final-normed hidden in its MTP input buffer, or
        with `capture` (a DFlash drafter's hook, StepRunner.run's) its features instead."""
        runner = self._runner

        def run(st):
            runner.run(st, meta, n, B, n, kv, state, snap=snap, capture=capture)
            if capture is None:
                runner.final_hidden(st, n)
        return self._get(("verify", n, B, id(kv), id(state), capture is not None), kv, state,
                         run)

    def chain(self, B: int, steps: int, kv, launches) -> Graph:
        """The MTP drafter's chain of `steps` steps over B rows (CudaModel.mtp_chain: each
        step's argmaxes feed the next on the device), launches(st, B, steps, kv) captured on
        first use."""
        return self._get(("chain", B, steps, id(kv)), kv, None,
                         lambda st: launches(st, B, steps, kv))

    def block(self, B: int, kv, run) -> Graph:
        """The DFlash drafter's block pass of B rows over kv (CudaModel.dflash_draft), run(st)
        captured on first use."""
        return self._get(("block", B, id(kv)), kv, None, run)

    def _get(self, key, kv, state, run) -> Graph:
        """The graph of `key`, or `run` captured as it (its GEMM plans and modules resolved by
        one dry run before the capture)."""
        entry = self._graphs.get(key)
        if entry is not None:
            return entry[0]
        t0 = time.perf_counter()
        runner = self._runner
        runner.dry = True
        try:
            run(self._stream)
        finally:
            runner.dry = False
        graph = Graph(self._stream, run)
        self._graphs[key] = (graph, kv, state)
        self.captured += 1
        self.capture_seconds += time.perf_counter() - t0
        return graph

    def forget(self, pool) -> None:
        """Destroy the graphs captured over `pool` (it is closing: a replay would write into
        whatever takes its regions next). The caller has bound the context."""
        stale = [key for key, (_, kv, state) in self._graphs.items() if pool is kv or pool is state]
        for key in stale:
            self._graphs.pop(key)[0].destroy()

    def take_all(self) -> list:
        """Every graph, removed from the set (the model's close destroys each)."""
        graphs = [g for g, _, _ in self._graphs.values()]
        self._graphs = {}
        return graphs
