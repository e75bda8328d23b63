"""The notebook's trained pair: a narrow 4-layer V4 target (SWA, SWA, CSA, HCA + its MTP-1 drafter) pre-trained on
experiments/train_drafter's Markov-chain language, then its drafter self-distilled on the target's own greedy
continuations (train_drafter's steps 0-3, unchanged). Saved in bf16 as config.json + model.safetensors (< 1 MB,
`model.checkpoint.load_checkpoint` reads it) with the training record, train_record.json.

    python -m experiments.notebooks.tiny_markov --out experiments/notebooks/tiny_markov

Its widths are cut from tiny-v4's (hidden 64, 2 heads of 32, 4 experts of 32) so the weights stay small enough to
commit (0.9 MB); the layer pattern, routing (two hash-routed layers) and drafter are tiny-v4's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np


def config():
    """tiny-v4 cut to 4 layers (experiments.layer_scaling.scale_layers) and narrowed: 0.4 M parameters."""
    from experiments.layer_scaling import scale_layers
    from model import ModelConfig

    return scale_layers(ModelConfig.preset("tiny-v4"), 4).replace(
        hidden_size=64, num_heads=2, head_dim=32, rope_head_dim=16, q_lora_rank=64, o_groups=2, o_lora_rank=32,
        index_n_heads=4, index_head_dim=32, n_routed_experts=4, moe_intermediate_size=32, name="tiny-v4-markov")


def build(out: Path, target_steps: int, drafter_steps: int, seed: int = 0) -> dict:
    """Train the pair and write out/{config.json, model.safetensors, train_record.json}. -> the record."""
    from experiments import train_drafter as td
    from model import init_random
    from model.checkpoint import build_from_tensors, official_tensors, save_safetensors
    from sampling.generate import generate

    t0 = time.perf_counter()
    cfg = config()
    model = init_random(cfg, seed=seed, dtype="float32")
    corpus = td.MarkovCorpus(cfg.vocab_size, seed=seed)
    pre = td.pretrain_target(model, corpus, target_steps, batch=16, seq_len=64, seed=seed)
    tc = td.TrainConfig(steps=drafter_steps, pool=128, corpus=corpus, warmup=25)
    prompts = td.random_prompts(cfg, 16, tc.prompt_len, seed=12345, corpus=corpus)
    plain = generate(model, prompts, max_new_tokens=32).tokens
    before = td.measure_acceptance(model, prompts, 32, tc.num_draft, plain)
    data = td.TargetData(model, tc)
    hist = td.train(model, data, tc, log_every=25)
    after = td.measure_acceptance(model, prompts, 32, tc.num_draft, plain)
    out.mkdir(parents=True, exist_ok=True)
    save_safetensors(build_from_tensors(cfg, official_tensors(model), dtype="bfloat16"), out)
    record = {
        "command": "python -m experiments.notebooks.tiny_markov " + " ".join(sys.argv[1:]),
        "config": cfg.name, "seed": seed, "corpus": dataclasses.asdict(corpus), "entropy_floor": corpus.entropy(),
        "target_steps": target_steps, "target_loss_first": pre["loss"][0],
        "target_loss_last10": float(np.mean(pre["loss"][-10:])), "drafter_steps": drafter_steps,
        "drafter_loss_last": hist["loss"][-1], "drafter_accept_len_last": hist["accept_len"][-1],
        "train_sequences": data.sequences, "eval": {"prompts": len(prompts), "new_tokens": 32, "greedy": True},
        "acceptance_before": before, "acceptance_after": after, "saved_dtype": "bfloat16",
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    (out / "train_record.json").write_text(json.dumps(record, indent=1))
    return record


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory for config.json, model.safetensors, train_record.json")
    p.add_argument("--target-steps", type=int, default=300)
    p.add_argument("--drafter-steps", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    rec = build(Path(args.out), args.target_steps, args.drafter_steps, args.seed)
    print(json.dumps({k: rec[k] for k in ("target_loss_last10", "entropy_floor", "wall_s")}),
          f"mean accepted length {rec['acceptance_before']['mean_accepted_length']:.2f} -> "
          f"{rec['acceptance_after']['mean_accepted_length']:.2f}")
    return rec


if __name__ == "__main__":
    main()
