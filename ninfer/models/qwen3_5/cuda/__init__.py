"""CUDA model internals: weight layout, device pools, per-call metadata, the step runner."""
