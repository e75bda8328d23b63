"""Mosaic GPU tilings the MoE kernel tests name (tests/test_kernels_moe.py and test_kernels_moe_lowering.py)."""

import dataclasses

from pallas_kernels import moe as K

FP8_ROWS = K.MgpuConfig(block_m=128, compute_wgs=2, block_n=64, block_k=128, block_n_down=128, block_k_down=128,
                        max_concurrent_steps=6)   # FP8 x FP8 row tiles: a K step is one 128-wide scale block
FP8_ROWS_3WG = dataclasses.replace(FP8_ROWS, block_m=192, compute_wgs=3, max_concurrent_steps=4)
