"""The caches a bench point starts from: synthetic (random contents, `lengths` set to the context; one compiled
fill, or numpy for small caches) or a real prefill of random prompts (deepinfer: one prompt, forked over the
batch), born sharded on a mesh; and host arrays put on the point's devices."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from experiments.bench import Point, Setup

HOST_FILL_BYTES = 64 << 20  # synthetic caches up to this size are filled by numpy (no compilation)


def _random_like(key, sds, forked: bool, vocab: int, lengths: int):
    """Random array for one cache leaf (forked: one sequence's values repeated over the batch)."""
    import jax
    import jax.numpy as jnp

    shape = sds.shape
    one = (1,) + tuple(shape[1:]) if forked else tuple(shape)
    if jnp.issubdtype(sds.dtype, jnp.integer):
        x = jax.random.randint(key, one, 0, vocab, sds.dtype)
    else:
        x = jax.random.normal(key, one, sds.dtype)
    return jnp.broadcast_to(x, shape) if forked else x


def synthetic(tree_fn, shardings, seed: int, forked: bool, vocab: int, length: int):
    """Fill every array of the pytree `tree_fn()` makes (a Cache or DraftCache) with random values and
    set its `lengths` to `length` ("synthetic context"). One jit; born with `shardings` on a mesh."""
    import jax
    import jax.numpy as jnp

    abstract = jax.eval_shape(tree_fn)
    total = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(abstract))
    if shardings is None and total <= HOST_FILL_BYTES:  # small: numpy on the host, no compilation
        rng = np.random.default_rng(seed)
        leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract)
        out = []
        for path, sds in leaves:
            one = (1,) + tuple(sds.shape[1:]) if forked else tuple(sds.shape)
            if jax.tree_util.keystr(path).endswith("lengths"):
                x = np.full(sds.shape, length)
            elif jnp.issubdtype(sds.dtype, jnp.integer):
                x = np.broadcast_to(rng.integers(0, vocab, one), sds.shape)
            else:
                x = np.broadcast_to(rng.standard_normal(one, np.float32), sds.shape)
            out.append(jnp.asarray(x, sds.dtype))
        return jax.tree_util.tree_unflatten(treedef, out)

    def make(key):
        leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract)
        out = []
        for i, (path, sds) in enumerate(leaves):
            name = jax.tree_util.keystr(path)
            if name.endswith("lengths"):
                out.append(jnp.full(sds.shape, length, sds.dtype))
            else:
                out.append(_random_like(jax.random.fold_in(key, i), sds, forked, vocab, length))
        return jax.tree_util.tree_unflatten(treedef, out)

    fn = jax.jit(make) if shardings is None else jax.jit(make, out_shardings=shardings)
    return fn(jax.random.PRNGKey(seed))


def new_cache(setup: Setup, batch: int, max_len: int, spec_room: int):
    import jax

    from model.cache import allocate

    cfg, dtype = setup.cfg, setup.model.dtype
    fn = lambda: allocate(cfg, batch, max_len, dtype, spec_room)  # noqa: E731
    if setup.mesh is None:
        return jax.jit(fn)(), None
    from model.sharded import cache_shardings

    shardings = cache_shardings(jax.eval_shape(fn), setup.mesh)
    return jax.jit(fn, out_shardings=shardings)(), shardings


def filled_cache(setup: Setup, p: Point, max_len: int, spec_room: int, length: int, forked: bool, rng):
    """A cache of `p.batch` sequences holding `length` positions: synthetic, or a real prefill of random
    prompts (deepinfer: one prompt prefilled once, its cache forked over the batch)."""
    import jax

    from model.cache import allocate

    cfg, dtype = setup.cfg, setup.model.dtype
    fn = lambda: allocate(cfg, p.batch, max_len, dtype, spec_room)  # noqa: E731
    shardings = None
    if setup.mesh is not None:
        from model.sharded import cache_shardings

        shardings = cache_shardings(jax.eval_shape(fn), setup.mesh)
    if length == 0:
        return new_cache(setup, p.batch, max_len, spec_room)[0]
    if not setup.real_prefill:
        return synthetic(fn, shardings, int(rng.integers(1 << 30)), forked, cfg.vocab_size, length)
    return real_prefill(setup, p, max_len, spec_room, length, forked, rng, shardings)


def real_prefill(setup: Setup, p: Point, max_len: int, spec_room: int, length: int, forked: bool, rng, shardings):
    import jax
    import jax.numpy as jnp

    from model.transformer import prefill

    n0 = p.batch
    if forked:  # one prompt (dp*ep identical rows on a mesh, which cannot hold fewer), then forked
        n0 = 1 if setup.mesh is None else int(np.prod(setup.mesh_shape[:2]))
    prompt = rng.integers(0, setup.cfg.vocab_size, (1 if forked else n0, length)).astype(np.int32)
    prompt = np.repeat(prompt, n0, axis=0) if forked else prompt
    cache, _ = new_cache(setup, n0, max_len, spec_room)
    chunk = 2048
    with setup.context():
        for s in range(0, length, chunk):
            tok = prompt[:, s:s + chunk]
            lens = np.full((n0,), tok.shape[1], np.int32)
            tok, lens = to_device(setup, tok), to_device(setup, lens)
            _, cache = prefill(setup.model, cache, tok, lens)
    if n0 == p.batch:
        return cache
    reps = p.batch // n0
    tile = jax.jit(lambda c: jax.tree.map(lambda x: jnp.tile(x, (reps,) + (1,) * (x.ndim - 1)), c),
                   out_shardings=shardings)
    return tile(cache)


def to_device(setup: Setup, x):
    import jax.numpy as jnp

    if setup.mesh is None:
        return jnp.asarray(x)
    from sharding import shard_batch

    return shard_batch(np.asarray(x), setup.mesh)
