"""The named configurations (`ModelConfig.preset(name)`): the tiny test configs of docs/model.md §0.4, the real
V4-Flash and V4.1-Flash, and V4-Flash widths at 4 layers for one-GPU benchmarks."""

from __future__ import annotations

from .config import ModelConfig, Yarn


def _tiny_v4() -> ModelConfig:
    # SWA, SWA(hash), CSA, HCA, CSA, HCA + one MTP slot; 16 indexer heads avoid exact top-k ties.
    return ModelConfig(
        vocab_size=256, hidden_size=128, num_layers=6, num_heads=4, head_dim=96, rope_head_dim=32,
        q_lora_rank=128, o_groups=2, o_lora_rank=64, sliding_window=8,
        compress_ratios=(0, 0, 4, 16, 4, 16, 0), rope_theta=10000.0, compress_rope_theta=40000.0,
        yarn=Yarn(factor=4.0, original_max_position_embeddings=32), max_position_embeddings=1024,
        rms_norm_eps=1e-6, index_n_heads=16, index_head_dim=64, index_topk=4, n_routed_experts=8,
        n_experts_per_tok=2, moe_intermediate_size=128, num_hash_layers=2, num_mtp_layers=1,
        name="tiny-v4",
    )


def _v4_flash() -> ModelConfig:
    return ModelConfig(
        vocab_size=129280, hidden_size=4096, num_layers=43, num_heads=64, head_dim=512, rope_head_dim=64,
        q_lora_rank=1024, o_groups=8, o_lora_rank=1024, sliding_window=128,
        compress_ratios=(0, 0) + (4, 128) * 20 + (4,) + (0,), rope_theta=10000.0,
        compress_rope_theta=160000.0,
        yarn=Yarn(factor=16.0, original_max_position_embeddings=65536, beta_fast=32, beta_slow=1),
        max_position_embeddings=1048576, rms_norm_eps=1e-6, index_n_heads=64, index_head_dim=128,
        index_topk=512, n_routed_experts=256, n_experts_per_tok=6, moe_intermediate_size=2048,
        num_hash_layers=3, num_mtp_layers=1, name="v4-flash",
    )


def _tiny_v41() -> ModelConfig:
    """docs/model.md §0.4 TINY-V41: SWA, SWA+Engram, Full(r2)+Engram, Reuse, Reuse, Full(r1)+candidate source,
    Reuse, Reindex with candidates; 3 DSpark stages."""
    return ModelConfig(
        vocab_size=96, hidden_size=128, num_layers=8, num_heads=4, head_dim=64, rope_head_dim=16,
        q_lora_rank=64, o_groups=2, o_lora_rank=32, sliding_window=8,
        compress_ratios=(0, 0, 2, 2, 2, 1, 1, 1, 0, 0, 0), rope_theta=10000.0, compress_rope_theta=40000.0,
        yarn=Yarn(factor=4.0, original_max_position_embeddings=64), max_position_embeddings=512,
        rms_norm_eps=1e-20, index_n_heads=8, index_head_dim=32, index_topk=4, n_routed_experts=8,
        n_experts_per_tok=3, moe_intermediate_size=128, num_hash_layers=0, swiglu_limit=1.0,
        num_mtp_layers=3, generation="v41", kv_source_layer_ids=(2, 5), index_source_layer_ids=(2, 5, 7),
        candidate_source_layer_id=5, candidate_topk_blocks=3, candidate_block_size=2,
        engram_layer_ids=(1, 2), engram_max_ngram_size=4, engram_vocab_size=50, engram_n_heads=2,
        engram_head_dim=64, engram_pad_token_id=2, engram_compressed_vocab_size=96,
        dspark_block_size=4, dspark_noise_token_id=95, dspark_target_layer_ids=(5, 6, 7), dspark_markov_rank=32,
        dspark_n_routed_experts=4, dspark_n_experts_per_tok=2, name="tiny-v41",
    )


def _v41_flash() -> ModelConfig:
    return ModelConfig(
        vocab_size=129280, hidden_size=5120, num_layers=40, num_heads=64, head_dim=512, rope_head_dim=64,
        q_lora_rank=1280, o_groups=8, o_lora_rank=1024, sliding_window=128,
        compress_ratios=(0, 0) + (2,) * 18 + (1,) * 20 + (0, 0, 0), rope_theta=10000.0,
        compress_rope_theta=160000.0,
        yarn=Yarn(factor=16.0, original_max_position_embeddings=65536, beta_fast=32, beta_slow=1),
        max_position_embeddings=1048576, rms_norm_eps=1e-20, index_n_heads=32, index_head_dim=128,
        index_topk=512, n_routed_experts=384, n_experts_per_tok=6, moe_intermediate_size=2304,
        num_hash_layers=0, num_mtp_layers=3, generation="v41", kv_source_layer_ids=(2, 8, 14, 20),
        index_source_layer_ids=(2, 8, 14, 20, 24, 28, 32, 36), candidate_source_layer_id=20,
        candidate_topk_blocks=2048, candidate_block_size=8, engram_layer_ids=(1, 14), engram_max_ngram_size=4,
        engram_vocab_size=16000000, engram_n_heads=8, engram_head_dim=256, engram_pad_token_id=2,
        engram_compressed_vocab_size=99092, engram_num_embeddings=(384006168, 384016682),
        dspark_block_size=5, dspark_noise_token_id=128799, dspark_target_layer_ids=(37, 38, 39),
        dspark_markov_rank=256, dspark_n_routed_experts=128, dspark_n_experts_per_tok=3, name="v41-flash",
    )


PRESETS = {"tiny-v4": _tiny_v4, "v4-flash": _v4_flash, "tiny-v41": _tiny_v41, "v41-flash": _v41_flash}


def _v4_flash_layers(num_layers: int) -> ModelConfig:
    """V4-Flash widths with fewer layers (benchmarks on one GPU): SWA, SWA, then CSA/HCA alternating."""
    base = _v4_flash()
    ratios = tuple(0 if i < 2 else (4 if i % 2 == 0 else 128) for i in range(num_layers)) + (0,)
    return base.replace(num_layers=num_layers, compress_ratios=ratios,
                        num_hash_layers=min(3, num_layers), name=f"v4-flash-{num_layers}l")


PRESETS["v4-flash-4l"] = lambda: _v4_flash_layers(4)
