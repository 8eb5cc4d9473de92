"""The runtime: EngineCore (request lifecycle, worker thread), Scheduler, ContextCache (the context
cache's policy: prefix index, sessions, retention, reclaim), GenerationHandle; CausalScoreCore in
scoring.py. docs/owners.md states what each owns; docs/architecture.md draws them."""
