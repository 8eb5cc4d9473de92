"""Tensor and expert parallel for the Qwen3.5 text model, proven on CPU first.

    comm        Communicator (the interface), LocalComm (N simulated ranks in one process)
    shard       split / merge one layer's parameters for rank r of N; the supported geometries;
                ShardingError
    tp_model    TensorParallelModel: the numpy model run as N rank shards + all-reduces

docs/architecture.md "Tensor and expert parallel (CPU-proven)" describes the layout. No NCCL
backend exists yet.
"""
from .comm import Communicator, LocalComm
from .shard import (ShardingError, attention_heads, check_geometry, linear_heads, merge_layer,
                    owned_experts, rank_config, shard_layer)
from .tp_model import TensorParallelModel

__all__ = ["Communicator", "LocalComm", "ShardingError", "TensorParallelModel", "attention_heads",
           "check_geometry", "linear_heads", "merge_layer", "owned_experts", "rank_config",
           "shard_layer"]
