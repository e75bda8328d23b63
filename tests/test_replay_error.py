"""CPU smoke test of experiments/replay_error.py (tiny-v41, one short length): the metrics, that the
measurement paths agree where they must, and the results files."""

from __future__ import annotations

import json

import numpy as np
import pytest

from experiments import replay_error as re_


def test_metrics():
    rng = np.random.default_rng(0)
    a = rng.normal(size=(3, 16)).astype(np.float32)
    same = re_.next_token_metrics(a, a.copy())
    assert same["kl"] == [0.0, 0.0, 0.0] and all(same["top1"]) and max(same["max_abs"]) == 0.0
    b = a.copy()
    b[0, a[0].argmax()] -= 10.0  # flips prompt 0's top-1
    m = re_.next_token_metrics(a, b)
    assert m["kl"][0] > 0.1 and m["kl"][1:] == [0.0, 0.0] and m["top1"] == [False, True, True]
    assert m["max_abs"][0] == pytest.approx(10.0)
    g = re_.greedy_agreement(np.array([[1, 2, 3, 4], [1, 2, 3, 4]]), np.array([[1, 2, 9, 4], [1, 2, 3, 4]]))
    assert g == {"prefix": [0.5, 1.0], "overall": [0.75, 1.0], "first_divergence": [2, 4]}
    assert re_.hit_points(64, 8, 16, [0.5, 0.75, 0.1]) == [32, 48]  # 0.1 -> 0 < W: no hit
    s = re_.summarize({**m, **g})
    assert s["top1_agree"] == pytest.approx(2 / 3) and s["greedy_prefix"] == 0.75


@pytest.mark.slow
def test_cli_smoke(tmp_path):
    """One length, two prompts, every mode: finite figures, an exact control, the hand-made encoder resume
    (timed as the device work) equal to the store path, and the results files."""
    out = re_.main(["--configs", "tiny", "--lengths", "32", "--prompts", "2", "--repeats", "1", "--new-tokens", "6",
                    "--num-draft", "0", "--out", str(tmp_path)])
    recs = out["records"]
    assert [(r["mode"], r.get("tail"), r.get("hit")) for r in recs] == [
        ("dec", 8, None), ("control", None, None), ("enc", None, 16)]
    for r in recs:
        assert np.isfinite([r["kl_mean"], r["kl_max"], r["max_abs_logit_diff"], r["t_mode_ms"], r["saved_pct"]]).all()
        assert 0 <= r["top1_agree"] <= 1 and 0 <= r["greedy_prefix"] <= r["greedy_overall"] <= 1
        assert len(r["per_prompt"]["kl"]) == 2 and r["t_exact_ms"] > 0
    control = recs[1]
    assert control["kl_max"] < 1e-9 and control["top1_agree"] == 1.0 and control["greedy_overall"] == 1.0
    assert recs[0]["kl_max"] > 0 and recs[2]["kl_max"] > 0
    assert recs[2]["resume_vs_store_max_abs"] < 1e-4 and recs[2]["t_store_ms"] > 0
    js, md = out["paths"]
    assert js.endswith(".json") and md.endswith(".md")
    saved = json.load(open(js))
    assert saved["env"]["backend"] == "cpu" and saved["env"]["jax"] and len(saved["records"]) == 3
    table = open(md).read()
    assert "| tiny-v41 | 8 | 32 | 2 | dec tail=8 |" in table and "enc H=16" in table


def test_bad_config():
    with pytest.raises(ValueError, match="V4.1"):
        re_.get_config("tiny-v4")
