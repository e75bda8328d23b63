"""Helpers shared by the tests (not a test module)."""

from __future__ import annotations

import contextlib
import json
import os
import zlib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np


def seed_of_test() -> int:
    """A fixed seed per test (from its pytest node id): inputs differ between tests, never between runs."""
    return zlib.crc32(os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0].encode()) % (1 << 30)


def cuda_text(f, *args, **kwargs) -> str:
    """The StableHLO text of `jax.jit(f)` lowered for CUDA on (abstract) arguments: a kernel's compiled form, checked
    from any host."""
    return jax.jit(f).trace(*args, **kwargs).lower(lowering_platforms=("cuda",)).as_text()


def rel_err(a, b) -> float:
    """Relative Frobenius error ||a - b|| / ||b|| in float64 (bf16 / fp32 inputs); NaN when `a` is not
    finite, so a comparison `rel_err(...) < tol` fails on it."""
    a = np.asarray(jnp.asarray(a, jnp.float32), np.float64)
    b = np.asarray(jnp.asarray(b, jnp.float32), np.float64)
    if not np.all(np.isfinite(a)):
        return float("nan")
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def simulated_devices_env(devices: int, **extra: str) -> dict:
    """This process's environment for a subprocess on `devices` simulated CPU devices: XLA_FLAGS keeps the test-wide
    CPU flags (tests/conftest.py: compile time dominates there too) and sets the device count."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "host_platform_device_count" not in f]
    return dict(os.environ, XLA_FLAGS=" ".join(flags + [f"--xla_force_host_platform_device_count={devices}"]),
                JAX_PLATFORMS="cpu", **extra)


def small_config(preset: str):
    """The tiny presets cut to their essentials (compile time dominates on CPU): V4 with one hash SWA, one CSA
    and one HCA layer (every V4 attention kind, the indexer included) and no MTP layer; V4.1 without its DSpark
    draft layers."""
    from model import ModelConfig

    cfg = ModelConfig.preset(preset)
    if preset == "tiny-v4":
        return cfg.replace(num_layers=3, compress_ratios=(0, 4, 16), num_hash_layers=1, num_mtp_layers=0)
    return cfg.replace(num_mtp_layers=0, compress_ratios=cfg.compress_ratios[:cfg.num_layers])


def small_v4():
    """tiny-v4 cut to one hash SWA, one CSA and one HCA layer, keeping its MTP layer (the drafting tests)."""
    from model import ModelConfig

    return ModelConfig.preset("tiny-v4").replace(num_layers=3, compress_ratios=(0, 4, 16, 0), num_hash_layers=1,
                                                 name="v4-small")


def small_v41():
    """tiny-v41 cut to four layers that keep every V4.1 layer kind with an indexer or a published state: SWA;
    Full r=2 + Engram (KV and index source); Full r=1 (candidate source); Reindex with candidates; its three
    DSpark stages target layers 1-3. (No Reuse layer: Reuse layers read what the sources publish.)"""
    from model import ModelConfig

    return ModelConfig.preset("tiny-v41").replace(
        num_layers=4, compress_ratios=(0, 2, 1, 1, 0, 0, 0), kv_source_layer_ids=(1, 2),
        index_source_layer_ids=(1, 2, 3), candidate_source_layer_id=2, engram_layer_ids=(1,),
        dspark_target_layer_ids=(1, 2, 3), name="v41-small")


def small_vocab(cfg, vocab: int):
    """`cfg` with a vocabulary of `vocab` tokens (V4.1: its Engram compressed vocabulary too, the DSpark noise token
    its last id): a random drafter's and target's distributions then overlap, so sampled drafts are accepted and
    rejected."""
    if cfg.generation == "v4":
        return cfg.replace(vocab_size=vocab)
    return cfg.replace(vocab_size=vocab, engram_compressed_vocab_size=vocab, dspark_noise_token_id=vocab - 1)


def load_golden(golden_dir: Path, name: str):
    """(model float32, prompts [B, S], continuation [B, D+1], outputs) of ../shared/golden/<name>."""
    from safetensors.numpy import load_file

    from model.checkpoint import load_checkpoint

    d = golden_dir / name
    inputs = json.loads((d / "inputs.json").read_text())
    return (load_checkpoint(d, dtype="float32"), np.asarray(inputs["prompts"]), np.asarray(inputs["continuation"]),
            load_file(d / "outputs.safetensors"))


def teacher_forced_decode(model, prompts: np.ndarray, cont: np.ndarray, steps: int = 8) -> np.ndarray:
    """Prefill the prompts, then feed cont[:, i] one token at a time -> logits [B, steps, V]."""
    from model.cache import allocate
    from model.transformer import decode, prefill

    b, s = prompts.shape
    cache = allocate(model.config, b, 64, jnp.float32)
    _, cache = prefill(model, cache, prompts, np.full(b, s))
    out = []
    for i in range(steps):
        logits, cache = decode(model, cache, cont[:, i])
        out.append(np.asarray(logits))
    return np.stack(out, 1)


@contextlib.contextmanager
def recording_topk_margins(margins: list):
    """While active, every top-k cut the reference model makes (indexer entries, candidate groups, router
    experts) appends to `margins` the smallest relative gap between its k-th and (k+1)-th scores (a host
    callback; rows with at most k finite scores make no cut). Only programs traced meanwhile record."""
    import jax

    import model.moe as moe
    from pallas_kernels import reference as ref

    def record(scores, k: int):
        def host(s):
            s = np.asarray(s, np.float64).reshape(-1, s.shape[-1])
            if s.shape[-1] <= k:
                return
            top = -np.sort(-s, axis=-1)[:, :k + 1]
            cut = np.isfinite(top[:, k])
            a, b = top[cut, k - 1], top[cut, k]
            if a.size:
                margins.append(float(np.min((a - b) / np.maximum(np.maximum(abs(a), abs(b)), 1e-30))))
        jax.debug.callback(host, scores)

    originals = ref.topk_indices, ref.top_candidate_groups, moe.top_k_ids

    def topk_indices(scores, k):
        record(scores, k)
        return originals[0](scores, k)

    def top_candidate_groups(group_max, reachable, topk_groups, group):
        record(group_max, topk_groups)
        return originals[1](group_max, reachable, topk_groups, group)

    def top_k_ids(scores, k):
        record(scores, k)
        return originals[2](scores, k)

    ref.topk_indices, ref.top_candidate_groups, moe.top_k_ids = topk_indices, top_candidate_groups, top_k_ids
    try:
        yield margins
    finally:
        ref.topk_indices, ref.top_candidate_groups, moe.top_k_ids = originals


def tie_free_tokens(model, seed: int, shape: tuple[int, int], low: int = 2, high: int | None = None,
                    bound: float = 1e-4, draws: int = 8) -> np.ndarray:
    """Seeded tokens [B, S] whose reference forward makes no top-k cut within `bound` (relative) of a tie, so
    that float noise between two implementations cannot flip a selection: near-ties are ruled out by
    construction (the tokens are drawn again), never absorbed by a tolerance."""
    import jax
    from flax import nnx

    high = model.config.vocab_size if high is None else high
    rng = np.random.default_rng(seed)
    for _ in range(draws):
        tokens = rng.integers(low, high, shape)
        margins: list = []
        with recording_topk_margins(margins):
            forward = nnx.jit(lambda m, t: m.forward(t)[0])  # a fresh program: traced with the recorders
            jax.block_until_ready(forward(model, jnp.asarray(tokens, jnp.int32)))
            jax.effects_barrier()
        if not margins or min(margins) > bound:
            return tokens
    raise AssertionError(f"{draws} token draws (seed {seed}) all have a top-k cut within {bound} of a tie")


def write_checkpoint(directory: Path, tensors: dict, config: dict) -> Path:
    """A one-file safetensors checkpoint: `tensors` under their stored names, and `config` as config.json."""
    from model import quant_io

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    quant_io.write_safetensors(directory / "model.safetensors", tensors)
    return directory


def release_compiled_code(share: float = 0.6) -> bool:
    """Drop jax's compiled programs (`jax.clear_caches`) once this process holds more than `share` of the kernel's
    memory-map limit: XLA:CPU maps each compiled program's code separately (a tiny model's batch-invariant forward:
    ~560 maps), and past /proc/sys/vm/max_map_count (65,530 here) its compiler fails with "Cannot allocate memory"
    or crashes. -> whether it dropped them (False where /proc is absent)."""
    try:
        limit = int(Path("/proc/sys/vm/max_map_count").read_text())
        with open("/proc/self/maps") as maps:
            held = sum(1 for _ in maps)
    except OSError:
        return False
    if held <= share * limit:
        return False
    jax.clear_caches()
    return True
