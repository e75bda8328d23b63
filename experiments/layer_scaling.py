"""A config scaled to N backbone layers keeping its layer pattern: the 4-layer V4-Flash the GPU benches run and
the depths a compile-time or roofline sweep walks."""

from __future__ import annotations


def _min_period(seq) -> int:
    for p in range(1, len(seq) + 1):
        if all(seq[i] == seq[i % p] for i in range(len(seq))):
            return p
    return max(len(seq), 1)


def scale_layers(cfg, num_layers: int):
    """`cfg` with `num_layers` backbone layers, keeping its layer pattern (draft slots unchanged).

    [V4] the leading SWA layers, then the preset's compressed ratios cycled with their period
    (v4-flash: CSA/HCA alternating; 4 layers = SWA, SWA, CSA, HCA as in the `v4-flash-4l` preset);
    hash layers min(num_hash_layers, n).
    [V4.1] encoder = first max(3, n // 2) layers (n // 2 for n < 4): the leading SWA layers, then ratio-2
    layers with a KV source every 6 layers (2, 8, 14, ...); decoder = the rest at ratio 1, its first
    layer the Full candidate source, an index source every 4 layers; Engram layers kept if inside the
    encoder; DSpark taps = the last 3 layers. n = 40 gives back the v41-flash preset.
    """
    n = int(num_layers)
    if n <= 0:
        raise ValueError(f"--layers must be positive, got {n}")
    m = cfg.num_mtp_layers
    ratios = list(cfg.compress_ratios[:cfg.num_layers])
    lead = next((i for i, r in enumerate(ratios) if r > 0), len(ratios))
    if cfg.generation == "v4":
        body = ratios[lead:] or [0]
        p = _min_period(body)
        new = [0 if i < lead else body[(i - lead) % p] for i in range(n)]
        return cfg.replace(num_layers=n, compress_ratios=tuple(new) + (0,) * m,
                           num_hash_layers=min(cfg.num_hash_layers, n), name=f"{cfg.name}-{n}l")
    # V4.1
    srcs = cfg.kv_source_layer_ids
    cand = cfg.candidate_source_layer_id
    enc_ratio = next((r for r in ratios if r > 1), 2)
    dec_ratio = ratios[cand] if cand >= 0 else 1
    enc_stride = (srcs[1] - srcs[0]) if len(srcs) >= 2 and srcs[1] < (cand if cand >= 0 else 10 ** 9) else 6
    dec_idx = [i for i in cfg.index_source_layer_ids if cand >= 0 and i > cand]
    dec_stride = (dec_idx[0] - cand) if dec_idx else 4
    n_enc = n // 2 if n < 4 else max(3, n // 2)
    new = [0 if i < min(lead, n_enc) else (enc_ratio if i < n_enc else dec_ratio) for i in range(n)]
    kv_src = [i for i in range(lead, n_enc, enc_stride)]
    idx_src = list(kv_src)
    cand_new = -1
    if n_enc < n:
        cand_new = n_enc
        kv_src.append(n_enc)
        idx_src += list(range(n_enc, n, dec_stride))
    eng = [(i, rows) for i, rows in zip(cfg.engram_layer_ids, cfg.engram_num_embeddings or [None] * len(cfg.engram_layer_ids))
           if i < n_enc]
    taps = tuple(range(max(0, n - len(cfg.dspark_target_layer_ids)), n)) if cfg.dspark_target_layer_ids else ()
    return cfg.replace(
        num_layers=n, compress_ratios=tuple(new) + (0,) * m, kv_source_layer_ids=tuple(kv_src),
        index_source_layer_ids=tuple(idx_src), candidate_source_layer_id=cand_new,
        engram_layer_ids=tuple(i for i, _ in eng),
        engram_num_embeddings=tuple(r for _, r in eng) if cfg.engram_num_embeddings else (),
        dspark_target_layer_ids=taps, name=f"{cfg.name}-{n}l")
