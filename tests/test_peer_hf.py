"""experiments/peer_hf.py: the HF peer is built from our config (`ModelConfig.to_hf_dict`) and times the
bench.py workload shapes; its comparison reads bench.py records."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import hf_oracle as H  # noqa: E402
from experiments import peer_hf  # noqa: E402
from model import ModelConfig  # noqa: E402


def test_hf_config_of_our_preset_is_the_oracles():
    """tiny-v4 written as an HF config builds the same model as the oracle's hand-written HF config
    (same weights from the same seed, same logits), and reads back to the same ModelConfig."""
    from transformers import DeepseekV4Config

    cfg = ModelConfig.preset("tiny-v4")
    assert ModelConfig.from_hf(cfg.to_hf_dict()) == cfg
    ours = H.build_hf_model(DeepseekV4Config(**cfg.to_hf_dict()), seed=0)
    oracle = H.build_hf_model(H.hf_tiny_config(compress_ratios=(0, 0, 4, 16, 4, 16, 0),
                                                 max_position_embeddings=cfg.max_position_embeddings), seed=0)
    tokens = np.random.default_rng(0).integers(2, 256, (2, 40))
    np.testing.assert_array_equal(H.hf_logits(ours, tokens), H.hf_logits(oracle, tokens))
    with pytest.raises(ValueError, match="V4 only"):
        ModelConfig.preset("tiny-v41").to_hf_dict()
    with pytest.raises(ValueError, match="one rate per layer type"):
        cfg.replace(compress_ratios=(0, 0, 4, 16, 4, 32, 0)).to_hf_dict()


def test_quick_run_and_comparison(tmp_path):
    bench = [{"status": "ok", "layers": 6, "devices": 1, "phase": "decode", "batch": 2, "context": 32,
              "new_tokens": 4, "mode": m, "step_ms": {"median": ms}} for m, ms in (("deepinfer", 1.0),
                                                                                   ("realistic", 2.0))]
    (tmp_path / "bench.json").write_text(json.dumps(bench))
    out = peer_hf.main(["--quick", "--out", str(tmp_path), "--ours", str(tmp_path / "bench.json")])
    recs = out["records"]
    assert {(r["phase"], r["context"], r["rows"]) for r in recs} == {
        ("prefill", 0, 16), ("prefill", 32, 16), ("decode", 0, 1), ("decode", 0, 4), ("decode", 32, 1),
        ("decode", 32, 4)}
    assert all(r["median_s"] > 0 and 0 < r["roofline"]["floor_s"] for r in recs)
    matched = [r for r in recs if "ours_median_s" in r]
    assert len(matched) == 1 and matched[0]["ours_median_s"] == 2e-3 and matched[0]["ours_mode"] == "realistic"
    assert len(list(tmp_path.glob("peer_hf_*.json"))) == 1 and len(list(tmp_path.glob("peer_hf_*.md"))) == 1


def test_peer_weights_route_over_many_experts():
    """transformers' init leaves the hash table at zeros (every token to expert 0); the peer's
    randomisation gives each token distinct experts, spread over all of them."""
    cfg = ModelConfig.preset("tiny-v4")
    model = peer_hf.hf_model(cfg, torch.device("cpu"), torch.float32, seed=0)
    tables = [b for n, b in model.named_buffers() if n.endswith("tid2eid")]
    assert len(tables) == cfg.num_hash_layers
    for t in tables:
        assert all(len(set(row)) == t.shape[1] for row in t.tolist())
        assert len(torch.unique(t)) == cfg.n_routed_experts
