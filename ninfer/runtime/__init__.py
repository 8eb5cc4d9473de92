"""The runtime: EngineCore (request lifecycle, worker thread), Scheduler, ResourceManager,
GenerationHandle; CausalScoreCore in scoring.py. docs/owners.md states what each owns."""
