"""Generate text from a preset (random weights) or a checkpoint, and report speed.

  python -m experiments.generate --preset tiny-v4 --batch 2 --prompt-len 32 --max-new-tokens 32
  python -m experiments.generate --checkpoint DIR --prompt "1 2 3 4" --dtype bfloat16

Prints the continuations, next-token logit statistics, tokens/s for prefill and decode and the
compile time of each phase (measured separately: the first call compiles, the second is timed). Compiled
programs are kept in the persistent compilation cache (experiments/compile_cache.py; `--compile-cache off`
disables it), so a second run loads them: the record says how many lookups hit.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import numpy as np

from experiments import compile_cache


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", default="tiny-v4", help="random-weight model preset (default tiny-v4)")
    src.add_argument("--checkpoint", help="directory with config.json + *.safetensors")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--seed", type=int, default=0, help="weights (presets) and sampling seed")
    p.add_argument("--prompt", action="append", help="space-separated token ids; repeat for a batch")
    p.add_argument("--batch", type=int, default=2, help="random prompts when --prompt is not given")
    p.add_argument("--prompt-len", type=int, default=32, help="length of random prompts (ragged: +-25%%)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--speculative", choices=["mtp", "dspark"], help="speculative decoding with the model's drafter")
    p.add_argument("--num-draft", type=int, help="drafts per speculative step (default 3)")
    p.add_argument("--scan-layers", action=argparse.BooleanOptionalAction, default=True,
                   help="run repeated layer groups as one scanned body each (ModelConfig.scan_layers; the same "
                   "numbers, a shorter compile: tiny-v4's first run 8.5 s against 11.4 unrolled on a quiet CPU); "
                   "--no-scan-layers traces every layer")
    compile_cache.add_argument(p)
    p.add_argument("--json", help="also write the stats record to this file")
    return p.parse_args(argv)


def progress(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def make_prompts(args, cfg) -> list[list[int]]:
    """--prompt token ids (checked against the vocabulary), or --batch random prompts of about --prompt-len."""
    if args.prompt:
        try:
            prompts = [[int(t) for t in p.split()] for p in args.prompt]
        except ValueError as e:
            raise ValueError(f"--prompt takes space-separated integer token ids ({e})") from None
        bad = [t for p in prompts for t in p if not 0 <= t < cfg.vocab_size]
        if not all(prompts) or bad:
            raise ValueError(f"--prompt needs non-empty prompts of token ids in [0, {cfg.vocab_size}); got {bad}")
        return prompts
    if args.batch < 1 or args.prompt_len < 1:
        raise ValueError(f"--batch and --prompt-len must be >= 1, got {args.batch} and {args.prompt_len}")
    rng = np.random.default_rng(args.seed)
    lo, hi = max(1, int(args.prompt_len * 0.75)), max(1, int(args.prompt_len * 1.25))
    return [rng.integers(2, cfg.vocab_size, rng.integers(lo, hi + 1)).tolist() for _ in range(args.batch)]


def main(argv=None) -> dict:
    args = parse_args(argv)
    cache_dir = compile_cache.enable(args.compile_cache)
    with compile_cache.CacheEvents() as events:
        record = run(args)
    print(f"compile cache: {events.status} ({events.hits} of {events.requests} programs loaded"
          f"{'' if cache_dir is None else ' from ' + str(cache_dir)})")
    record["compile_cache"] = {**events.record(), "dir": None if cache_dir is None else str(cache_dir)}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
    return record


def run(args: argparse.Namespace) -> dict:
    from model import ModelConfig, init_random
    from model.cache import describe_memory
    from model.checkpoint import load_checkpoint
    from model.footprint import check_fits
    from sampling.generate import DEFAULT_NUM_DRAFT, check_request, generate, request_length

    # every argument is checked against the config before the model is built (seconds, not a stall)
    layout = {"scan_layers": args.scan_layers}
    cfg = ModelConfig.from_hf(args.checkpoint) if args.checkpoint else ModelConfig.preset(args.preset)
    cfg = cfg.replace(**layout)
    options = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                   top_p=args.top_p, seed=args.seed, stop_tokens=[cfg.eos_token_id], timing=True,
                   speculative=args.speculative, num_draft=args.num_draft)
    check_request(cfg, **options)
    prompts = make_prompts(args, cfg)
    max_len = request_length(cfg, max(map(len, prompts)), args.max_new_tokens,
                             (args.num_draft or DEFAULT_NUM_DRAFT) if args.speculative else None)
    check_fits(cfg, args.dtype, len(prompts), max_len)

    t0 = time.perf_counter()
    if args.checkpoint:
        progress(f"loading {args.checkpoint}")
        model = load_checkpoint(args.checkpoint, dtype=args.dtype, **layout)
    else:
        progress(f"building random {args.preset}")
        model = init_random(cfg, seed=args.seed, dtype=args.dtype)
    cfg = model.config
    progress(f"model ready in {time.perf_counter() - t0:.1f} s: {cfg.name}, {cfg.num_layers} layers")
    progress(describe_memory(cfg, max(map(len, prompts)) + args.max_new_tokens, len(prompts)))

    # Next-token logits of the first prompt (a quick look at the model's output distribution).
    logits = np.asarray(model(np.asarray([prompts[0]])))[0, -1]
    progress("compiling and running prefill + decode (first run compiles, second is timed)")
    out = generate(model, prompts, **options)
    s = out.stats
    print(f"next-token logits of prompt 0: mean {logits.mean():.4f} std {logits.std():.4f} "
          f"max {logits.max():.4f} argmax {int(logits.argmax())}")
    for i, (p, toks) in enumerate(zip(prompts, out.tokens)):
        gen = [int(t) for t in toks if t >= 0]
        print(f"[{i}] prompt ({len(p)} tokens) ... {p[-8:]} -> {gen}")
    n_prompt, decoded = sum(map(len, prompts)), int(out.lengths.sum()) - len(prompts)
    print(f"prefill: {n_prompt} tokens in {s['prefill_s'] * 1e3:.1f} ms = {n_prompt / s['prefill_s']:.1f} "
          f"tokens/s (compile {s['prefill_compile_s']:.1f} s)")
    steps = s["spec_steps"] if args.speculative else s["decode_steps"]
    print(f"decode:  {steps} steps x {len(prompts)} sequences, {decoded} tokens in {s['decode_s'] * 1e3:.1f} ms = "
          f"{decoded / s['decode_s']:.1f} tokens/s (compile {s['decode_compile_s']:.1f} s)")
    if args.speculative:
        print(f"speculative ({args.speculative}, {s['num_draft']} drafts): mean accepted length "
              f"{s['mean_accepted_length']:.2f} tokens/step, per position "
              f"{np.round(s['acceptance_per_position'], 3).tolist()}; verify {s['verify_s'] * 1e3:.1f} ms, "
              f"draft {s['draft_s'] * 1e3:.1f} ms")
    return {"model": cfg.name, "dtype": args.dtype, "batch": len(prompts), "backend": jax.default_backend(),
            "device": str(jax.devices()[0]), "jax": jax.__version__, "scan_layers": cfg.scan_layers, **s}


if __name__ == "__main__":
    main()
