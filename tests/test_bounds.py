"""Bounds and early checks: what cannot work fails in seconds, before a model is built or a loop compiled —
drafts beyond what the drafter chains, a model or cache that cannot fit the device, bad CLI arguments."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from model import ModelConfig, footprint, init_random
from model import quant_io
from model.cache import allocate
from model.checkpoint import load_checkpoint
from sampling.generate import check_request

GIB = 1024 ** 3


@pytest.fixture
def two_gib(monkeypatch):
    """A device with 2 GiB free, whatever machine runs the test."""
    monkeypatch.setattr(footprint, "available_bytes", lambda device=None: 2 * GIB)


def test_num_draft_bounded_by_the_drafter():
    with pytest.raises(ValueError, match=r"num_draft 64 exceeds the 8 drafts MTP-1 chains"):
        check_request(ModelConfig.preset("tiny-v4"), speculative="mtp", num_draft=64)
    with pytest.raises(ValueError, match=r"num_draft 5 exceeds the DSpark block size 4"):
        check_request(ModelConfig.preset("tiny-v41"), speculative="dspark", num_draft=5)


def test_model_that_cannot_fit_raises_before_building(two_gib):
    t0 = time.perf_counter()
    with pytest.raises(MemoryError, match=r"v4-flash-4l's parameters in float32 needs 126\.\d+ GiB, but .* has "
                                          r"2\.00 GiB free: use a smaller config, bfloat16"):
        init_random(ModelConfig.preset("v4-flash-4l"), dtype="float32")
    assert time.perf_counter() - t0 < 60
    footprint.check_fits(ModelConfig.preset("tiny-v4"), "float32", batch=4, max_len=512)  # fits


def test_checkpoint_that_cannot_fit_raises_before_reading(two_gib, tmp_path):
    """Only config.json and the tensor names are read before the check."""
    cfg = ModelConfig.preset("v4-flash-4l")
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_official_dict()))
    quant_io.write_safetensors(tmp_path / "model.safetensors", {"embed.weight": np.zeros((2, 2), np.float32)})
    with pytest.raises(MemoryError, match=r"parameters in bfloat16 needs 51\.\d+ GiB"):
        load_checkpoint(tmp_path, dtype="bfloat16")


def test_cache_that_cannot_fit_raises_before_allocating(two_gib):
    with pytest.raises(MemoryError, match=r"a v4-flash cache of 64 x 1048576 positions \(bfloat16\) needs "
                                          r"\d+\.\d+ GiB, but .* has 2\.00 GiB free"):
        allocate(ModelConfig.preset("v4-flash"), 64, 1 << 20)
    with pytest.raises(MemoryError, match=r"tiny-v4's parameters in float32 \(0\.\d+ GiB\) \+ a cache of 4096 x 1024 "
                                          r"positions \(\d+\.\d+ GiB\) needs"):
        footprint.check_fits(ModelConfig.preset("tiny-v4"), "float32", batch=4096, max_len=1024)


def test_traced_allocation_is_not_checked(two_gib):
    """Shapes only (eval_shape, born-sharded jit): nothing is held, so nothing is refused."""
    import jax

    shapes = jax.eval_shape(lambda: allocate(ModelConfig.preset("v4-flash"), 64, 1 << 20))
    assert shapes.lengths.shape == (64,)


# ----------------------------------------------------------------------------- the CLIs

CLI_BAD = [
    (["--top-p", "0"], ValueError, r"top_p must be a number in \(0, 1\]"),
    (["--temperature", "-1"], ValueError, r"temperature must be a finite number >= 0"),
    (["--top-k", "-2"], ValueError, r"top_k must be an integer >= 0"),
    (["--max-new-tokens", "0"], ValueError, r"max_new_tokens must be an integer >= 1"),
    (["--num-draft", "2"], ValueError, r"num_draft=2 needs speculative decoding"),
    (["--speculative", "mtp", "--num-draft", "64"], ValueError, r"num_draft 64 exceeds the 8 drafts MTP-1 chains"),
    (["--speculative", "dspark"], ValueError, r"DSpark drafting needs a V4.1 model"),
    (["--prompt", "1 two 3"], ValueError, r"--prompt takes space-separated integer token ids"),
    (["--prompt", "1 2 999"], ValueError, r"token ids in \[0, 256\); got \[999\]"),
    (["--batch", "0"], ValueError, r"--batch and --prompt-len must be >= 1"),
    (["--max-new-tokens", "5000"], ValueError, r"exceeds the model's context of 1024 positions"),
    (["--preset", "v4-flash-4l"], MemoryError, r"v4-flash-4l's parameters in float32 \(126\.\d+ GiB\) \+ a cache"),
]


@pytest.mark.parametrize("argv,error,message", CLI_BAD, ids=[" ".join(a) for a, _, _ in CLI_BAD])
def test_generate_cli_rejects_before_building(two_gib, capsys, argv, error, message):
    from experiments import generate as main_job

    t0 = time.perf_counter()
    with pytest.raises(error, match=message):
        main_job.main(argv)
    assert time.perf_counter() - t0 < 60
    assert "building" not in capsys.readouterr().err  # refused before the model was built


def test_bench_says_kernel_times_need_a_gpu():
    from experiments.bench import kernel_times_note

    assert kernel_times_note("gpu", 3) is None and kernel_times_note("cpu", 0) is None
    assert "per-kernel times need CUPTI on a GPU; on cpu the steps are timed as usual" in kernel_times_note("cpu", 3)
