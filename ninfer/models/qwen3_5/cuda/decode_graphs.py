"""DecodeGraphs: one CUDA graph per exact decode batch size B over one (KV pool, State pool).

The graph replays runner.run over the decode metadata buffer, so its inputs (token ids,
positions, block tables, state slots) are whatever was copied into that buffer before the launch.
A graph writes into its pools' arena regions: closing a pool destroys the graphs captured over it
(forget), before the regions go back to the arena.
"""
from __future__ import annotations

from ....core.cuda.graph import Graph


class DecodeGraphs:
    def __init__(self, stream, runner, meta):
        self._stream, self._runner, self._meta = stream, runner, meta
        # (B, id(kv), id(state)) -> (graph, kv, state): the entry holds the pools, so their ids
        # cannot be reused while it lives
        self._graphs: dict = {}

    def __len__(self) -> int:
        return len(self._graphs)

    def get(self, B: int, kv, state) -> Graph:
        """The graph of B rows over (kv, state), captured on first use (its GEMM plans and
        modules resolved by one dry run before the capture)."""
        key = (B, id(kv), id(state))
        entry = self._graphs.get(key)
        if entry is not None:
            return entry[0]
        runner, meta = self._runner, self._meta

        def run(st):
            runner.run(st, meta, B, B, B, kv, state)
        runner.dry = True
        try:
            run(self._stream)
        finally:
            runner.dry = False
        graph = Graph(self._stream, run)
        self._graphs[key] = (graph, kv, state)
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
