"""TextConfig fields of the bench shapes (bench/bench_decode.py, docs/performance.md) and a tiny
MoE one, for the CPU-side tests of the CUDA layer's plans (memory, workspace, kernel specs)."""

SHAPES = {
    "27B": dict(hidden_size=5120, intermediate_size=17408, num_attention_heads=24,
                num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
                linear_num_value_heads=48, vocab_size=248320),
    "35B-A3B": dict(hidden_size=2048, is_moe=True, num_experts=256, num_experts_per_tok=8,
                    moe_intermediate_size=512, shared_expert_intermediate_size=512,
                    num_attention_heads=16, num_key_value_heads=2, head_dim=256,
                    linear_num_key_heads=16, linear_num_value_heads=32, vocab_size=248320),
    "tiny-moe": dict(hidden_size=64, is_moe=True, num_experts=8, num_experts_per_tok=2,
                     moe_intermediate_size=32, shared_expert_intermediate_size=48,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                     linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                     linear_value_head_dim=16, vocab_size=300),
}
