"""The runtime: EngineCore (request lifecycle, worker thread), Scheduler, ResourceManager,
GenerationHandle; CausalScoreCore in scoring.py. See DESIGN.md section 2."""
