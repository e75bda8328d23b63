"""HF-transformers oracle for jaxinfer's DeepSeek-V4-Flash (TINY-V4) tests.

Helper module (not a test file).  transformers 5.24.0, torch 2.13 (CPU), float32, eager attention.

    import hf_oracle as H   # tests/ on sys.path (pytest rootdir/conftest or sys.path.insert)
    from hf_oracle import hf_tiny_config, build_hf_model, save_hf_model, hf_logits, hf_greedy
    cfg = hf_tiny_config();  model = build_hf_model(cfg, seed=0)
    logits = hf_logits(model, tokens)            # [B,T] int -> [B,T,V] float32, no cache
    new    = hf_greedy(model, tokens, n_new)     # model.generate greedy with the DynamicCache
    names  = save_hf_model(model, "/tmp/ckpt")   # save_pretrained -> model.safetensors + config.json

Extra helpers: ``hf_prefill_decode_logits`` (prefill + teacher-forced 1-token decodes through the
cache), ``hf_greedy_reference`` (cache-free greedy), ``official_state_dict`` /
``save_official_checkpoint`` (same tensors under the official checkpoint names),
``discrete_margins`` / ``check_no_near_ties`` (smallest relative gap at every indexer top-k cut, every
router top-k cut and every logits argmax), ``first_near_ties`` (per batch row, the first position with a
near-tie at a top-k cut, in float64), ``perturb_weights_``.  ``python tests/hf_oracle.py`` runs
a self-check.

===================================================================================================
0. VERIFIED (B=2, T=220, seed 0, tokens = default_rng(1234).integers(2,256))
===================================================================================================
* logits are finite, std 1.01, max|.| 4.4.  hf_logits(use_cache=False) and the one-shot cached
  prefill give identical logits (bitwise).
* An independent float64 re-implementation of docs/model.md §1-§6, §8, §9, §11 (own code, scratch file,
  reads official_state_dict names, *with* the indexer Hadamard) matches HF's fp32 logits to max|d|
  1.3e-5 (relative 2.9e-6), with the same argmax everywhere; running it without the Hadamard gives the
  same result.  So, with quant-sim off, HF == the V4 model of docs/model.md except for the points in section 4.
  This also checks the key table of section 3 (w1/w3 order, wo_a grouping, ...).
* Cache consistency: prefill 183 + 37 single-token decodes vs full forward: max|d| 7.5e-6 (this
  crosses CSA emissions and the HCA ratio-16 emissions at p=191, 207); chunked prefill 37/50/61/72
  vs one shot: 5.7e-6; ``generate`` (B=2, 12 new tokens, DynamicCache) == cache-free greedy
  (identical tokens), per-step generate logits vs full forward: max|d| 8.9e-6.  HF's cached path is
  consistent with its full forward.  Smallest top1-top2 relative margin over the 12 greedy steps:
  7.8e-5.
* Discrete margins, seed 0 (smallest relative gap over all cuts): indexer l2 1.2e-4, l4 1.8e-4;
  router l2 6.3e-5, l3 1.0e-3, l4 7.7e-4, l5 1.2e-4; argmax 1.4e-4.  Seeds 1 and 2: indexer
  >= 2.7e-4, router >= 2.0e-5.  With index_n_heads=4 the indexer has EXACT ties (margin 0 for every
  seed): 6.6% of causally valid indexer scores are exactly 0.0 (all 4 ReLU(q.k) terms are zero), so
  top-k among them depends on tie-breaking.  With 16 heads no score is exactly 0.  Keep HI=16; call
  check_no_near_ties(model, tokens) on any new test input.
* save/reload: every format reloads with from_pretrained with no missing or unexpected keys and
  bitwise-equal weights.  Logits after reload: max|d| 0 (original-format and official files) or 9.5e-7
  (pure-HF file: same weights, but a different BLAS path for the mmapped tensors).
* Timings on this 2-core CPU, measured while nothing else was running: `import transformers` model
  classes ~2.5 s (once per process), hf_tiny_config 1 ms, build_hf_model 0.07 s, forward B=2 T=220
  0.07-0.09 s, generate 12 tokens 0.25 s, prefill+37 decodes 0.6 s, cache-free greedy 12 tokens
  0.9 s.  When another process (a JAX job) was using the CPU, the same calls took 10-100x longer.
  A forward at T=600 > max_position_embeddings works.

===================================================================================================
1. CONFIG (hf_tiny_config) - HF field names
===================================================================================================
HF's DeepseekV4Config does not use the official `compress_ratios` / `num_hash_layers` /
`qk_rope_head_dim` / `rope_scaling` fields.  DeepseekV4Config.__post_init__ converts them:
  compress_ratios (per layer, MTP slot dropped by truncating to num_hidden_layers) ->
      layer_types[l] in {"sliding_attention" (0), "compressed_sparse_attention" (4),
      "heavily_compressed_attention" (128)} through _COMPRESS_RATIO_TO_LAYER_TYPE, which knows ONLY
      0/4/128.  `compress_ratios=[0,0,4,16,...]` raises KeyError 16.  For TINY we therefore pass
      layer_types=[SWA,SWA,CSA,HCA,CSA,SWA] and
      compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16}.
      There is ONE rate per layer TYPE.  Every CSA layer has the overlap compressor and the indexer,
      every HCA layer has the non-overlap compressor and no indexer, whatever the rate.
  num_hash_layers=2 -> mlp_layer_types = ["hash_moe"]*2 + ["moe"]*4
  qk_rope_head_dim=32 -> partial_rotary_factor = 32/96 (the runtime attribute qk_rope_head_dim is
      recomputed from it and also written to config.json)
  rope: pass a flat YaRN dict in rope_parameters; __post_init__ nests it as
      {"main":     {"rope_type":"default", "rope_theta":10000, "partial_rotary_factor":1/3},
       "compress": {"rope_type":"yarn", "factor":4.0, "original_max_position_embeddings":32,
                    "beta_fast":32, "beta_slow":1, "rope_theta":40000 (=compress_rope_theta),
                    "partial_rotary_factor":1/3, "attention_factor":1.0}}
      (a legacy `rope_scaling={"type":"yarn",...}` is folded in the same way.)
Values: vocab 256, hidden 128, moe_intermediate_size 128, 6 layers, 4 heads, 1 kv head, head_dim 96,
q_lora_rank 128, o_groups 2, o_lora_rank 64, sliding_window 8, index_n_heads 16, index_head_dim 64,
index_topk 4, n_routed_experts 8, num_experts_per_tok 2, n_shared_experts 1, scoring sqrtsoftplus,
routed_scaling_factor 1.5, hc 4/20/1e-6, swiglu_limit 10, rms_norm_eps 1e-6,
max_position_embeddings 512, num_nextn_predict_layers 1, tie_word_embeddings False, bos 0, eos 1.
Overrides: any HF field, plus compress_ratios / num_hash_layers / qk_rope_head_dim / yarn
(translated as above).

max_position_embeddings: HF uses it (a) in _compute_yarn_parameters ONLY when `factor` is missing
(factor = max_pos/orig); we give factor=4, so it is not used.  A config validator then logs "factor
4.0 does not match max_pos/orig = 16"; the explicit factor wins, and hf_tiny_config silences the
warning.  (b) In DeepseekV4RotaryEmbedding.max_seq_len_cached, which only the dynamic/longrope
rope types read.  There is no position limit.  512 is safe, and T=600 runs.  max_pos=128
(docs/model.md §0.4) would also work and makes the warning go away (128/32 = 4).

config.json written by save_hf_model (save_pretrained) - exact key set:
  architectures ["DeepseekV4ForCausalLM"], attention_bias, attention_dropout, bos_token_id,
  compress_rates, compress_rope_theta, dtype ("float32"), eos_token_id, hc_eps, hc_mult,
  hc_sinkhorn_iters, head_dim, hidden_act, hidden_size, index_head_dim, index_n_heads, index_topk,
  initializer_range, layer_types, max_position_embeddings, mlp_bias, mlp_layer_types, model_type
  ("deepseek_v4"), moe_intermediate_size, n_routed_experts, n_shared_experts, norm_topk_prob,
  num_attention_heads, num_experts_per_tok, num_hidden_layers, num_key_value_heads,
  num_nextn_predict_layers, o_groups, o_lora_rank, output_router_logits, pad_token_id (null),
  partial_rotary_factor, q_lora_rank, qk_rope_head_dim, rms_norm_eps, rope_parameters
  ({"main":{...},"compress":{...}} as above), rope_theta, routed_scaling_factor,
  router_aux_loss_coef, router_jitter_noise, scoring_func, sliding_window, swiglu_limit,
  tie_word_embeddings, transformers_version, use_cache, vocab_size.
  (It has NO compress_ratios, num_hash_layers, rope_scaling or quantization_config.)  Also
  generation_config.json = {bos_token_id 0, eos_token_id 1, use_cache true, ...}.
A jaxinfer config loader should accept both this HF form and the official form.

===================================================================================================
2. WEIGHTS (build_hf_model)
===================================================================================================
DeepseekV4ForCausalLM(config) is built under torch.random.fork_rng (the global RNG is unchanged), in
float32, eval(), _attn_implementation="eager".  Experts use transformers' default "grouped_mm"
implementation; it gives the same maths as the eager loop.  Then perturb_weights_ overwrites
every learned tensor, in sorted-name order, from one torch.Generator(seed).  N = standard normal.
  *norm.weight / *layernorm.weight (q_a_norm, kv_norm, compressor(.indexer).kv_norm,
      input_layernorm, post_attention_layernorm, model.norm)   1 + 0.1 N
  attn_hc/ffn_hc .fn, hc_head.hc_fn           0.05 N
  .base, hc_base                              0.2 N
  .scale, hc_scale                            0.5 + 0.2 N
  self_attn.sinks                             0.5 N
  mlp.gate.e_score_correction_bias (buffer)   0.3 N
  compressor(.indexer).position_bias (= ape)  0.1 N
  model.embed_tokens.weight                   0.5 N
  every other 2-D weight [out,in]             N * in^-0.5   (lm_head, all projections, router gate)
  mlp.experts.gate_up_proj [E,2I,D]           N * D^-0.5 ;  down_proj [E,D,I]   N * I^-0.5
  mlp.gate.tid2eid [V,k] (buffer, int64)      per token: the first k of a random permutation of the E
                                              experts (k distinct experts)
The only things not perturbed are the rotary inv_freq buffers, which are not persistent and are
derived from the config.

===================================================================================================
3. CHECKPOINT LAYOUT (save_hf_model) and the HF -> official name table
===================================================================================================
save_hf_model(model, dir) (default original_format=False) writes ONE model.safetensors (metadata
{"format":"pt"}), 168 tensors, all float32 except tid2eid (int64).  Every linear weight is
nn.Linear-style [out, in], the same orientation as the official checkpoint, so NO transposition is
needed anywhere.  Experts are STACKED, and gate+up are FUSED (gate first).
Layer sets: all = 0..5, CSA = {2,4}, HCA = {3}, hash = {0,1}, scored = {2,3,4,5}.

 HF key (shape for TINY)                                           official name (docs/model.md §14)
 ----------------------------------------------------------------  ---------------------------------
 model.embed_tokens.weight [256,128]                               embed.weight
 lm_head.weight [256,128]  (untied)                                head.weight
 model.norm.weight [128]                                           norm.weight
 model.hc_head.hc_fn [4,512] / .hc_base [4] / .hc_scale [1]        hc_head_fn / hc_head_base / hc_head_scale
 model.layers.{l}.attn_hc.fn [24,512] / .base [24] / .scale [3]    layers.{l}.hc_attn_fn / hc_attn_base / hc_attn_scale
 model.layers.{l}.ffn_hc.fn [24,512] / .base [24] / .scale [3]     layers.{l}.hc_ffn_fn / hc_ffn_base / hc_ffn_scale
 model.layers.{l}.input_layernorm.weight [128]                     layers.{l}.attn_norm.weight
 model.layers.{l}.post_attention_layernorm.weight [128]            layers.{l}.ffn_norm.weight
 model.layers.{l}.self_attn.q_a_proj.weight [128,128]              layers.{l}.attn.wq_a.weight
 model.layers.{l}.self_attn.q_a_norm.weight [128]                  layers.{l}.attn.q_norm.weight
 model.layers.{l}.self_attn.q_b_proj.weight [384,128]              layers.{l}.attn.wq_b.weight   (rows = head-major H x Dh)
 model.layers.{l}.self_attn.kv_proj.weight [96,128]                layers.{l}.attn.wkv.weight
 model.layers.{l}.self_attn.kv_norm.weight [96]                    layers.{l}.attn.kv_norm.weight
 model.layers.{l}.self_attn.o_a_proj.weight [128,192]              layers.{l}.attn.wo_a.weight   ([G*o_lora, H*Dh/G]; view [G,o_lora,H*Dh/G])
 model.layers.{l}.self_attn.o_b_proj.weight [128,128]              layers.{l}.attn.wo_b.weight
 model.layers.{l}.self_attn.sinks [4]                              layers.{l}.attn.attn_sink
 -- CSA (l in {2,4}) --
 ...self_attn.compressor.kv_proj.weight [192,128]                  layers.{l}.attn.compressor.wkv.weight   (rows [0:96]=A half, [96:192]=B half)
 ...self_attn.compressor.gate_proj.weight [192,128]                layers.{l}.attn.compressor.wgate.weight
 ...self_attn.compressor.position_bias [4,192]                     layers.{l}.attn.compressor.ape
 ...self_attn.compressor.kv_norm.weight [96]                       layers.{l}.attn.compressor.norm.weight
 ...self_attn.compressor.indexer.kv_proj.weight [128,128]          layers.{l}.attn.indexer.compressor.wkv.weight
 ...self_attn.compressor.indexer.gate_proj.weight [128,128]        layers.{l}.attn.indexer.compressor.wgate.weight
 ...self_attn.compressor.indexer.position_bias [4,128]             layers.{l}.attn.indexer.compressor.ape
 ...self_attn.compressor.indexer.kv_norm.weight [64]               layers.{l}.attn.indexer.compressor.norm.weight
 ...self_attn.compressor.indexer.q_b_proj.weight [1024,128]        layers.{l}.attn.indexer.wq_b.weight      (rows = HI x DI, head-major)
 ...self_attn.compressor.indexer.scorer.weights_proj.weight [16,128]  layers.{l}.attn.indexer.weights_proj.weight
 -- HCA (l = 3) --
 ...self_attn.compressor.kv_proj.weight [96,128]                   layers.{l}.attn.compressor.wkv.weight
 ...self_attn.compressor.gate_proj.weight [96,128]                 layers.{l}.attn.compressor.wgate.weight
 ...self_attn.compressor.position_bias [16,96]                     layers.{l}.attn.compressor.ape
 ...self_attn.compressor.kv_norm.weight [96]                       layers.{l}.attn.compressor.norm.weight
 -- MoE (all layers) --
 model.layers.{l}.mlp.gate.weight [8,128]                          layers.{l}.ffn.gate.weight
 model.layers.{l}.mlp.gate.tid2eid [256,2] int64   (hash layers)   layers.{l}.ffn.gate.tid2eid
 model.layers.{l}.mlp.gate.e_score_correction_bias [8] (scored)    layers.{l}.ffn.gate.bias
 model.layers.{l}.mlp.experts.gate_up_proj [8,256,128]             layers.{l}.ffn.experts.{e}.w1.weight = gate_up_proj[e, :I, :]
                                                                   layers.{l}.ffn.experts.{e}.w3.weight = gate_up_proj[e, I:, :]
 model.layers.{l}.mlp.experts.down_proj [8,128,128]                layers.{l}.ffn.experts.{e}.w2.weight = down_proj[e]
 model.layers.{l}.mlp.shared_experts.gate_proj.weight [128,128]    layers.{l}.ffn.shared_experts.w1.weight
 model.layers.{l}.mlp.shared_experts.up_proj.weight [128,128]      layers.{l}.ffn.shared_experts.w3.weight
 model.layers.{l}.mlp.shared_experts.down_proj.weight [128,128]    layers.{l}.ffn.shared_experts.w2.weight
 (not in HF at all: mtp.0.* - see 4.13; the FP8/FP4 `.scale` tensors - HF files are fp32.)
Count: 6 top-level + 23 per layer x 6 + 10 per CSA layer x 2 + 4 for the HCA layer = 168.  In the
official layout (per-expert w1/w2/w3): 300.
This table is transformers' conversion_mapping["deepseek_v4"] (official -> HF renames, plus
MergeModulelist(dim=0)+Concatenate(dim=1) for w1/w3 -> gate_up_proj and MergeModulelist for w2),
written out.  official_state_dict() is its inverse.  save_official_checkpoint() writes exactly
those names (no "model." prefix), and from_pretrained loads that file back bitwise.
Pitfall: save_pretrained's DEFAULT (save_original_format=True, i.e. save_hf_model(...,
original_format=True)) reverses the renames only partly and gives a HYBRID layout that is neither
HF nor official: "model.layers.{l}.attn.wq_a.weight", per-expert "model.layers.{l}.ffn.experts.{e}.w1
.weight", "model.layers.{l}.hc_attn_fn", "head.weight", but "model.embed_tokens.weight",
"model.norm.weight", "model.hc_head.hc_fn", and the main kv_norm written as
"model.layers.{l}.attn.norm.weight" (the official name is attn.kv_norm.weight).  Don't build a
loader against that format.

===================================================================================================
4. SEMANTICS: HF (modeling_deepseek_v4.py) vs docs/model.md (V4).  "SAME" means verified equal
   (section 0); the real differences are marked DIFF.
===================================================================================================
4.1  RoPE [DeepseekV4RotaryEmbedding, apply_rotary_pos_emb]: SAME.  Interleaved pairs
     (x[2k], x[2k+1]) of the LAST R=32 dims of each 96-dim head: out = (a cos - b sin, a sin + b cos),
     angle = p * inv_freq[k], computed in fp32.  rotate_half is the interleaved form (-x[1::2], x[0::2]).
     Two inv_freq tables: "main" = 10000^(-2k/32), no YaRN, for sliding_attention layers;
     "compress" = YaRN(theta 40000) for CSA/HCA layers.  The compress table is used for that layer's
     q, its SWA kv, its compressed entries and its indexer q/k.  The compressor and indexer own their
     DeepseekV4RotaryEmbedding instances, built from the same config, so the tables are identical.
4.2  YaRN [_compute_yarn_parameters]: SAME as spec 2.3.  c(b) = R ln(orig/(2 pi b)) / (2 ln theta),
     with orig = rope_parameters.compress.original_max_position_embeddings (32, NOT
     max_position_embeddings); lo = max(floor(c(beta_fast)), 0), hi = min(ceil(c(beta_slow)), R-1)
     (truncate=True); ramp_k = clip((k-lo)/(hi-lo), 0, 1) over k < R/2, with hi += 0.001 only if
     lo == hi; inv_freq = w/factor * ramp + w * (1-ramp).  attention_factor is forced to 1.0, so cos/sin
     are not scaled (no mscale).  TINY: lo=0, hi=3, so k=0 is not interpolated, k=1,2 are partly
     interpolated (ramp 1/3, 2/3), k>=3 are divided by 4.  compress inv_freq[:4] = [1.0, 0.38675,
     0.13296, 0.034281].  Real config: lo=15, hi=25.
4.3  q path [DeepseekV4Attention.forward]: SAME.  c_q = q_a_norm(q_a_proj h) (weighted RMSNorm);
     q = q_b_proj c_q -> [H,Dh]; q_b_norm = DeepseekV4UnweightedRMSNorm: q_h * rsqrt(mean(q_h^2) +
     rms_norm_eps), per head, no weight, applied BEFORE RoPE; then RoPE.  kv = kv_norm(kv_proj h),
     then RoPE; K = V = kv (one shared head).
4.4  Attention/sink [eager_attention_forward]: SAME.  logits = q.k * head_dim^-0.5 (1/sqrt(96)) +
     mask; the per-head `sinks` value is appended as an extra logit column (NOT scaled by 1/sqrt(Dh),
     NOT added to the keys); softmax over [keys..., sink], then the sink column is dropped, which
     equals exp(sink) in the denominator only.  A max-subtraction is applied first (no effect on the
     maths).  SWA mask: key s visible iff q-W < s <= q (W=8 keys including itself)
     [sliding_window_overlay].  The DynamicSlidingWindowLayer cache keeps the last W-1 rows and
     concatenates the new rows.
4.5  Inverse RoPE on the output: SAME.  apply_rotary_pos_emb(attn_out, cos, -sin) with the query
     position and the layer's own table (main/compress), applied to the last R dims of every head
     output.
4.6  Grouped output [DeepseekV4GroupedLinear]: SAME.  o [B,S,H*Dh] -> G=2 contiguous groups of
     H*Dh/G=192; u_g = W_oa.view(G, o_lora, 192)[g] @ o_g; out = o_b_proj(concat_g u_g).
4.7  Compressor (CSA overlap, DeepseekV4CSACompressor; indexer key DeepseekV4Indexer): SAME as spec
     2.5 ("official" overlap).  kv = kv_proj h, gate = gate_proj h + position_bias[t mod r]; only
     complete windows (usable = floor(T/r)*r); each window is [B,nW,r,2d].  Slots 0..r-1 are the
     PREVIOUS window's A half (kv[..., :d], gate[..., :d]); slots r..2r-1 are the CURRENT window's B
     half ([..., d:]).  The first window's A slots are kv 0 / gate -inf (no cache) or the carried
     overlap state (cache).  softmax over the 2r slots, per channel, in fp32; C = sum(softmax * kv);
     then kv_norm (weighted RMSNorm, eps=rms_norm_eps); then RoPE at position j*r (+ entry_count*r
     under the cache).  ape's first d columns go with A, because it is added before the split.
     Indexer-key compressor: same code with d = DI = 64, its own kv_proj/gate_proj [2*DI, D],
     position_bias [r, 2*DI], kv_norm [DI], always with overlap.
     HCA (DeepseekV4HCACompressor): C_j = sum over the r tokens of softmax_t(gate + position_bias)
     * kv, then kv_norm, then RoPE at j*r.  All SAME.
4.8  Visibility: SAME.  HCA: entry j visible iff j < floor((p+1)/r) (block_bias in
     DeepseekV4HCACompressor; with seq_len==1 in decode block_bias is None and every cached entry is
     visible, which is the same set).  CSA: only the indexer-selected entries are visible
     (DeepseekV4CSACompressor builds block_bias by scattering 0 at the valid top-k indices).
4.9  Indexer [DeepseekV4Indexer, DeepseekV4IndexerScorer]: SAME up to the Hadamard.
     qI = q_b_proj(c_q) (c_q = q_a_norm output; qI gets NO per-head norm) -> [HI=16, DI=64]; RoPE on
     the last R=32 dims of each index head with the compress table at the query position; keys from
     the indexer compressor (4.7), RoPE'd at j*r.  score[p,j] = sum_h (ReLU(qI_h . K_j) * DI^-0.5) *
     (weights_proj(h)_h * HI^-0.5), where h = the attention input (input_layernorm(collapse)).
     Future entries j >= floor((p+1)/r) are set to -inf; torch.topk(k = min(index_topk,
     n_entries_total)); picks that land on future entries become -1 (invalid), so in effect it is
     top-min(K, floor((p+1)/r)).  Tie order is whatever torch.topk gives (see the HI=4 note in 0).
     DIFF: HF has NO Hadamard transform and NO FP4 quant-sim on qI / K.  The Sylvester Hadamard /
     sqrt(DI) is orthonormal, so qI.K is unchanged: with quant-sim off this is not a real difference
     (checked in float64).  Apply the Hadamard only together with the FP4 sim, or compare against
     HF with quant-sim off.
4.10 mHC [DeepseekV4HyperConnection]: SAME as spec 2.2.  flat = X.view(B,S,n*D) in fp32;
     input_norm = unweighted RMSNorm over all n*D values (eps = rms_norm_eps); m = flat_normed @
     fn^T (the same as spec's rho*(fn.x)); split [pre n | post n | comb n*n]; pre = sigmoid(m*scale0
     + base) + hc_eps; post = 2*sigmoid(m*scale1 + base); comb = softmax(m*scale2 + base, over the last
     axis = rows) + hc_eps; then comb /= colsum+hc_eps; then (iters-1)=19 times (comb /= rowsum+eps;
     comb /= colsum+eps).  collapse y = sum_i pre_i X_i.  Update
     [DeepseekV4DecoderLayer.forward]: X'_k = post_k*F + sum_j comb[j,k]*X_j (matmul(comb^T, X)),
     which is spec X'_j = post_j F + sum_i comb_ij X_i.  Block: attn_hc -> input_layernorm -> attn
     -> update; ffn_hc -> post_attention_layernorm -> MoE -> update.  The V4 per-sublayer pre-mix,
     with no carry.
4.11 hc_head [DeepseekV4HyperHead]: SAME.  a = sigmoid(rmsnorm_unweighted(flat) @ hc_fn^T *
     hc_scale + hc_base) + hc_eps; no Sinkhorn; y = sum a_i X_i; then model.norm; then lm_head
     (untied).
4.12 MoE [DeepseekV4TopKRouter, DeepseekV4HashRouter, DeepseekV4Experts, DeepseekV4MLP]:
     s = sqrt(softplus(gate.weight @ h)) (SqrtSoftplusActivation; torch softplus is linear above 20).
     Scored layers: idx = topk(s + e_score_correction_bias, k, sorted=False); w = s[idx].
     Hash layers: idx = tid2eid[input_ids] (NO bias), w = s[idx].  Both: w = w/(sum w + 1e-20) *
     routed_scaling_factor.
       DIFF (negligible): 1e-20 in the normaliser (spec V4: no eps).  Both norm_topk_prob and
       n_shared_experts are IGNORED (the weights are always normalised; there is always exactly one
       shared DeepseekV4MLP of width moe_intermediate_size).
     Expert: gate_up = gate_up_proj[e] @ x; gate, up = chunk(2) (the first I rows = w1/gate);
     gate.clamp(max=L); up.clamp(-L, L); z = silu(gate)*up; y = down_proj[e] @ z; THEN
     y *= routing weight.
       DIFF (rounding only): spec multiplies z by the weight BEFORE W2; the two are equal because it
       is linear.
     Shared expert: the same clamped SwiGLU (clamp on gate max=L, up +-L), weight 1.  out = sum of
     the routed outputs + shared.  Clamped SwiGLU: SAME for routed and shared.  The hash router
     needs input_ids (it fails with inputs_embeds).
4.13 MTP: DIFF - HF does NOT implement MTP.  No module; `mtp.*` keys are dropped on load
     (_keys_to_ignore_on_load_unexpected); num_nextn_predict_layers is only stored in the config;
     the MTP compress-ratio slot is truncated away.  There is no HF oracle for mtp.0 (e_proj/h_proj/
     enorm/hnorm/hc_head/norm) or for speculative verification: _is_stateful=True disables assisted
     generation, and the compressor cache cannot be rolled back.
4.14 Quantisation: DIFF - HF has no fake-quant at all (no act_quant, no FP8 KV nope sim, no FP4
     indexer sim, no bf16 rounding of the sparse-attention probabilities).  HF in fp32 = jaxinfer with
     quant_sim off.
4.15 Precision: the compressor/indexer projections and the router run in the activation dtype
     (fp32 here; in a bf16 model they would run in bf16, with the compressor softmax explicitly fp32).  The mHC,
     hc_head, norms, sinks and position_bias are kept in fp32 (_keep_in_fp32_modules_strict).  No
     difference in fp32 tests.
4.16 Padding/positions: position_ids = arange(T) + cache length, shared by the whole batch.  The
     compressors and the indexer IGNORE attention_mask: pad tokens are compressed like real tokens
     and positions are not shifted for left padding.  Only compare unpadded, equal-length batches
     (hf_greedy does this).  Incremental state [DeepseekV4CSACache/HCACache]: raw (kv, gate-without-
     ape) rows of the incomplete window are buffered; the CSA overlap carry stores the last window's
     A half (with ape); entries are emitted when a window completes.  Chunked prefill and 1-token
     decode match the one-shot forward (section 0).
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
from typing import Any

import numpy as np
import torch

__all__ = [
    "TINY_COMPRESS_RATIOS",
    "hf_tiny_config",
    "build_hf_model",
    "save_hf_model",
    "official_state_dict",
    "save_official_checkpoint",
    "hf_logits",
    "hf_prefill_decode_logits",
    "hf_greedy",
    "hf_greedy_reference",
    "discrete_margins",
    "first_near_ties",
    "check_no_near_ties",
    "perturb_weights_",
]

# Per-layer compress ratios of TINY-V4, including the trailing MTP slot (docs/model.md §0.4).
TINY_COMPRESS_RATIOS = (0, 0, 4, 16, 4, 0, 0)

_SWA, _CSA, _HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"


@contextlib.contextmanager
def _quiet_transformers():
    """Silence transformers' logger (the YaRN 'factor does not match max_pos/orig' warning)."""
    lg = logging.getLogger("transformers")
    old = lg.level
    lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        lg.setLevel(old)


def _ratios_to_layer_types(ratios, num_layers):
    ratios = list(ratios)[:num_layers]
    hca = sorted({r for r in ratios if r not in (0, 4)})
    if len(hca) > 1:
        raise ValueError(f"HF supports one HCA rate for all HCA layers, got {hca}")
    types = [_SWA if r == 0 else (_CSA if r == 4 else _HCA) for r in ratios]
    rates = {_CSA: 4, _HCA: hca[0] if hca else 128}
    return types, rates


def hf_tiny_config(**overrides: Any):
    """TINY-V4 as a transformers ``DeepseekV4Config``.

    ``overrides`` are passed to ``DeepseekV4Config`` (HF field names), except these
    official-style convenience keys which are translated first:
      * ``compress_ratios``  list (may include trailing MTP slot) -> ``layer_types`` + ``compress_rates``
        (0 -> sliding, 4 -> CSA (overlap compressor + indexer), any other r -> HCA with rate r),
      * ``num_hash_layers``  -> ``mlp_layer_types``,
      * ``qk_rope_head_dim`` -> ``partial_rotary_factor``,
      * ``yarn`` dict        -> replaces the YaRN sub-dict of ``rope_parameters``.
    """
    from transformers import DeepseekV4Config

    ov = dict(overrides)
    num_layers = ov.pop("num_hidden_layers", 6)
    head_dim = ov.pop("head_dim", 96)
    ratios = ov.pop("compress_ratios", TINY_COMPRESS_RATIOS)
    num_hash = ov.pop("num_hash_layers", 2)
    rope_dim = ov.pop("qk_rope_head_dim", 32)
    yarn = ov.pop(
        "yarn",
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 32, "beta_slow": 1},
    )
    layer_types, compress_rates = _ratios_to_layer_types(ratios, num_layers)
    kw = dict(
        vocab_size=256,
        hidden_size=128,
        moe_intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=head_dim,
        partial_rotary_factor=rope_dim / head_dim,
        q_lora_rank=128,
        o_groups=2,
        o_lora_rank=64,
        sliding_window=8,
        layer_types=layer_types,
        compress_rates=compress_rates,
        mlp_layer_types=["hash_moe"] * min(num_hash, num_layers) + ["moe"] * max(0, num_layers - num_hash),
        compress_rope_theta=40000.0,
        rope_theta=10000.0,
        # flat YaRN dict: __post_init__ builds {"main": default(rope_theta), "compress": yarn(compress_rope_theta,
        # attention_factor=1.0)}
        rope_parameters=dict(yarn),
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        index_n_heads=16,
        index_head_dim=64,
        index_topk=4,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        scoring_func="sqrtsoftplus",
        norm_topk_prob=True,
        routed_scaling_factor=1.5,
        hc_mult=4,
        hc_sinkhorn_iters=20,
        hc_eps=1e-6,
        swiglu_limit=10.0,
        hidden_act="silu",
        num_nextn_predict_layers=1,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=None,
        use_cache=True,
    )
    kw.update(ov)
    with _quiet_transformers():
        cfg = DeepseekV4Config(**kw)
    cfg._attn_implementation = "eager"
    return cfg


# ----------------------------------------------------------------------------------------------
# Model construction with non-trivial weights
# ----------------------------------------------------------------------------------------------


def _perturb_rule(name: str, t: torch.Tensor):
    """Return (kind, fn(normal_sample)->tensor) for a learned tensor, or None to skip."""
    leaf = name.rsplit(".", 1)[-1]
    if "rotary_emb" in name:  # inv_freq buffers: derived from config, not learned
        return None
    if leaf == "tid2eid":
        return "tid2eid", None
    if leaf in ("fn", "hc_fn"):
        return "hc_fn", lambda n: 0.05 * n
    if leaf in ("base", "hc_base"):
        return "hc_base", lambda n: 0.2 * n
    if leaf in ("scale", "hc_scale"):
        return "hc_scale", lambda n: 0.5 + 0.2 * n
    if leaf == "sinks":
        return "sink", lambda n: 0.5 * n
    if leaf == "e_score_correction_bias":
        return "gate_bias", lambda n: 0.3 * n
    if leaf == "position_bias":
        return "ape", lambda n: 0.1 * n
    if name.endswith("embed_tokens.weight"):
        return "embed", lambda n: 0.5 * n
    if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
        return "norm", lambda n: 1.0 + 0.1 * n
    if leaf in ("gate_up_proj", "down_proj") and t.dim() == 3:  # stacked experts [E, out, in]
        s = t.shape[-1] ** -0.5
        return "matrix", lambda n: s * n
    if leaf == "weight" and t.dim() == 2:
        s = t.shape[-1] ** -0.5
        return "matrix", lambda n: s * n
    raise ValueError(f"no perturbation rule for {name} {tuple(t.shape)}")


@torch.no_grad()
def perturb_weights_(model, seed: int = 0) -> dict[str, str]:
    """Overwrite every learned parameter / persistent buffer deterministically from ``seed``.

    Returns {name: kind}. Tensors are visited in sorted-name order with one torch.Generator,
    so the result depends only on (config, seed).
    """
    g = torch.Generator(device="cpu").manual_seed(int(seed))
    tensors = dict(model.named_parameters())
    tensors.update({n: b for n, b in model.named_buffers()})
    kinds = {}
    for name in sorted(tensors):
        t = tensors[name]
        rule = _perturb_rule(name, t)
        if rule is None:
            continue
        kind, fn = rule
        kinds[name] = kind
        if kind == "tid2eid":
            V, k = t.shape
            n_exp = model.config.n_routed_experts
            perm = torch.argsort(torch.rand(V, n_exp, generator=g), dim=-1)[:, :k]
            t.copy_(perm.to(t.dtype))
            continue
        n = torch.randn(t.shape, generator=g, dtype=torch.float32)
        t.copy_(fn(n).to(t.dtype))
    return kinds


def build_hf_model(config=None, seed: int = 0):
    """``DeepseekV4ForCausalLM`` in float32 / eval / eager attention with all weights perturbed."""
    from transformers import DeepseekV4ForCausalLM

    if config is None:
        config = hf_tiny_config()
    with torch.random.fork_rng(devices=[]), _quiet_transformers():
        model = DeepseekV4ForCausalLM(config)
    model = model.to(torch.float32).eval()
    model.config._attn_implementation = "eager"
    perturb_weights_(model, seed)
    return model


# ----------------------------------------------------------------------------------------------
# Saving
# ----------------------------------------------------------------------------------------------


def save_hf_model(model, directory: str, original_format: bool = False) -> list[str]:
    """``model.save_pretrained(directory)`` as a single ``model.safetensors`` + config.json +
    generation_config.json. Returns the sorted list of tensor names written.

    original_format=False (default): pure HF module names (see docstring table, column 1),
      experts stacked ``mlp.experts.gate_up_proj [E, 2I, D]`` / ``down_proj [E, D, I]``.
    original_format=True: transformers' default ``save_original_format=True``, which runs the
      ``conversion_mapping['deepseek_v4']`` renames in reverse -> a *hybrid* naming
      (``model.layers.{l}.attn.wq_a.weight``, per-expert ``ffn.experts.{e}.w1.weight``, but
      ``model.embed_tokens.weight``, ``model.hc_head.hc_fn``, ``model.norm.weight``, ``head.weight``).
      Both reload with ``from_pretrained``.
    """
    from safetensors import safe_open

    os.makedirs(directory, exist_ok=True)
    with _quiet_transformers():
        model.save_pretrained(directory, safe_serialization=True, save_original_format=original_format)
    names = []
    for fn in sorted(os.listdir(directory)):
        if fn.endswith(".safetensors"):
            with safe_open(os.path.join(directory, fn), framework="pt") as f:
                names.extend(f.keys())
    return sorted(names)


def official_state_dict(model) -> dict[str, torch.Tensor]:
    """HF model -> tensors under the official DeepSeek-V4 checkpoint names (docs/model.md §14),
    unquantised (fp32), no ``model.`` prefix, experts split per expert, no MTP tensors.
    Inverse of transformers' ``conversion_mapping['deepseek_v4']``."""
    out: dict[str, torch.Tensor] = {}
    sd = model.state_dict()
    I = model.config.moe_intermediate_size
    top = {
        "model.embed_tokens.weight": "embed.weight",
        "lm_head.weight": "head.weight",
        "model.norm.weight": "norm.weight",
        "model.hc_head.hc_fn": "hc_head_fn",
        "model.hc_head.hc_base": "hc_head_base",
        "model.hc_head.hc_scale": "hc_head_scale",
    }
    sub = [  # (HF suffix inside layer, official suffix) - order matters (longest first)
        ("self_attn.compressor.indexer.scorer.weights_proj.weight", "attn.indexer.weights_proj.weight"),
        ("self_attn.compressor.indexer.q_b_proj.weight", "attn.indexer.wq_b.weight"),
        ("self_attn.compressor.indexer.kv_proj.weight", "attn.indexer.compressor.wkv.weight"),
        ("self_attn.compressor.indexer.gate_proj.weight", "attn.indexer.compressor.wgate.weight"),
        ("self_attn.compressor.indexer.position_bias", "attn.indexer.compressor.ape"),
        ("self_attn.compressor.indexer.kv_norm.weight", "attn.indexer.compressor.norm.weight"),
        ("self_attn.compressor.kv_proj.weight", "attn.compressor.wkv.weight"),
        ("self_attn.compressor.gate_proj.weight", "attn.compressor.wgate.weight"),
        ("self_attn.compressor.position_bias", "attn.compressor.ape"),
        ("self_attn.compressor.kv_norm.weight", "attn.compressor.norm.weight"),
        ("self_attn.q_a_proj.weight", "attn.wq_a.weight"),
        ("self_attn.q_a_norm.weight", "attn.q_norm.weight"),
        ("self_attn.q_b_proj.weight", "attn.wq_b.weight"),
        ("self_attn.kv_proj.weight", "attn.wkv.weight"),
        ("self_attn.kv_norm.weight", "attn.kv_norm.weight"),
        ("self_attn.o_a_proj.weight", "attn.wo_a.weight"),
        ("self_attn.o_b_proj.weight", "attn.wo_b.weight"),
        ("self_attn.sinks", "attn.attn_sink"),
        ("input_layernorm.weight", "attn_norm.weight"),
        ("post_attention_layernorm.weight", "ffn_norm.weight"),
        ("attn_hc.fn", "hc_attn_fn"),
        ("attn_hc.base", "hc_attn_base"),
        ("attn_hc.scale", "hc_attn_scale"),
        ("ffn_hc.fn", "hc_ffn_fn"),
        ("ffn_hc.base", "hc_ffn_base"),
        ("ffn_hc.scale", "hc_ffn_scale"),
        ("mlp.gate.weight", "ffn.gate.weight"),
        ("mlp.gate.e_score_correction_bias", "ffn.gate.bias"),
        ("mlp.gate.tid2eid", "ffn.gate.tid2eid"),
        ("mlp.shared_experts.gate_proj.weight", "ffn.shared_experts.w1.weight"),
        ("mlp.shared_experts.up_proj.weight", "ffn.shared_experts.w3.weight"),
        ("mlp.shared_experts.down_proj.weight", "ffn.shared_experts.w2.weight"),
    ]
    for k, v in sd.items():
        if "rotary_emb" in k:
            continue
        if k in top:
            out[top[k]] = v.clone()
            continue
        assert k.startswith("model.layers."), k
        l, rest = k[len("model.layers.") :].split(".", 1)
        pre = f"layers.{l}."
        if rest == "mlp.experts.gate_up_proj":
            for e in range(v.shape[0]):
                out[pre + f"ffn.experts.{e}.w1.weight"] = v[e, :I].clone()
                out[pre + f"ffn.experts.{e}.w3.weight"] = v[e, I:].clone()
            continue
        if rest == "mlp.experts.down_proj":
            for e in range(v.shape[0]):
                out[pre + f"ffn.experts.{e}.w2.weight"] = v[e].clone()
            continue
        for a, b in sub:
            if rest == a:
                out[pre + b] = v.clone()
                break
        else:
            raise KeyError(f"unmapped HF key {k}")
    return out


def save_official_checkpoint(model, directory: str) -> list[str]:
    """Write ``official_state_dict(model)`` as ``model.safetensors`` + the HF config.json.
    ``DeepseekV4ForCausalLM.from_pretrained(directory)`` loads it through transformers'
    conversion mapping (used by the self-check to validate the key table)."""
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    sd = {k: v.contiguous() for k, v in official_state_dict(model).items()}
    save_file(sd, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    model.config.save_pretrained(directory)
    return sorted(sd)


# ----------------------------------------------------------------------------------------------
# Running
# ----------------------------------------------------------------------------------------------


def _ids(tokens) -> torch.Tensor:
    a = np.asarray(tokens)
    if a.ndim == 1:
        a = a[None]
    return torch.from_numpy(a.astype(np.int64))


@torch.no_grad()
def hf_logits(model, tokens, use_cache: bool = False) -> np.ndarray:
    """Full-sequence forward, [B,T] int -> [B,T,V] float32.

    use_cache=False (default) runs the stateless compressor path (no DynamicCache is created).
    use_cache=True runs the same one-shot prefill through a fresh DynamicCache (identical maths).
    """
    ids = _ids(tokens)
    out = model(input_ids=ids, use_cache=use_cache)
    return out.logits.float().numpy()


@torch.no_grad()
def hf_prefill_decode_logits(model, tokens, n_prefill: int) -> np.ndarray:
    """Teacher-forced incremental run: prefill tokens[:, :n_prefill] into a DynamicCache, then feed
    the remaining tokens one at a time. Returns the logits of every position, [B,T,V] float32."""
    from transformers import DynamicCache

    ids = _ids(tokens)
    B, T = ids.shape
    cache = DynamicCache(config=model.config)
    outs = []
    out = model(input_ids=ids[:, :n_prefill], cache=cache, use_cache=True)
    outs.append(out.logits)
    cache = out.cache
    for t in range(n_prefill, T):
        out = model(input_ids=ids[:, t : t + 1], cache=cache, use_cache=True)
        outs.append(out.logits)
        cache = out.cache
    return torch.cat(outs, dim=1).float().numpy()


@torch.no_grad()
def hf_greedy(model, tokens, n_new: int, return_logits: bool = False):
    """``model.generate`` greedy with the KV/compressor cache. [B,T] -> [B,n_new] int64.

    EOS is disabled (eos_token_id=None) so every row produces exactly n_new tokens and no logit is
    masked. With return_logits=True also returns the per-step raw logits [B,n_new,V] float32.
    """
    from transformers import GenerationConfig

    ids = _ids(tokens)
    gc = GenerationConfig(
        do_sample=False,
        num_beams=1,
        max_new_tokens=int(n_new),
        min_new_tokens=0,
        eos_token_id=None,
        pad_token_id=0,
        bos_token_id=None,
        use_cache=True,
        return_dict_in_generate=True,
        output_logits=True,
    )
    with _quiet_transformers():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=gc)
    new = out.sequences[:, ids.shape[1] :].numpy()
    assert new.shape == (ids.shape[0], n_new), new.shape
    if return_logits:
        lg = torch.stack(out.logits, dim=1).float().numpy()
        return new, lg
    return new


@torch.no_grad()
def hf_greedy_reference(model, tokens, n_new: int) -> np.ndarray:
    """Cache-free greedy: re-runs the full forward (use_cache=False) for every new token."""
    ids = _ids(tokens)
    for _ in range(n_new):
        lg = model(input_ids=ids, use_cache=False).logits[:, -1]
        ids = torch.cat([ids, lg.argmax(-1, keepdim=True)], dim=1)
    return ids[:, -n_new:].numpy()


# ----------------------------------------------------------------------------------------------
# Near-tie diagnostics for every discrete decision (indexer top-k, router top-k, argmax)
# ----------------------------------------------------------------------------------------------


def _cut_gaps(scores: torch.Tensor, valid: torch.Tensor, k: int):
    """Per row: relative gap between k-th and (k+1)-th valid score (rows with > k valid)."""
    s = scores.masked_fill(~valid, float("-inf"))
    nvalid = valid.sum(-1)
    rows = nvalid > k
    if not rows.any():
        return torch.empty(0), torch.empty(0)
    top = s[rows].topk(k + 1, dim=-1).values
    a, b = top[:, k - 1], top[:, k]
    gap = a - b
    rel = gap / torch.maximum(a.abs(), b.abs()).clamp_min(1e-30)
    return gap, rel


@torch.no_grad()
def discrete_margins(model, tokens) -> dict[str, float]:
    """Run a cache-free forward and report the smallest relative margin at every discrete cut:

    * ``indexer_l{l}``: CSA indexer top-k cut (k-th vs (k+1)-th causally valid score), per layer,
    * ``router_l{l}``: score-routed MoE top-k cut on (sqrtsoftplus(logits) + bias),
    * ``argmax``: logits top-1 vs top-2 over all positions.
    A value ~1e-6 or below means the selection can flip under float32 reordering.
    """
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as M

    ids = _ids(tokens)
    B, T = ids.shape
    rec: dict[str, list] = {}
    hooks = []
    for l, layer in enumerate(model.model.layers):
        comp = getattr(layer.self_attn, "compressor", None)
        if isinstance(comp, M.DeepseekV4CSACompressor):
            idx = comp.indexer

            def _h(mod, args, out, l=l, idx=idx):
                rec.setdefault(f"indexer_l{l}", []).append((out, idx.compress_rate, idx.index_topk))

            hooks.append(idx.scorer.register_forward_hook(_h))
        gate = layer.mlp.gate
        if isinstance(gate, M.DeepseekV4TopKRouter):

            def _g(mod, args, out, l=l, gate=gate):
                logits = out[0]
                rec.setdefault(f"router_l{l}", []).append(
                    (gate.score_fn(logits) + gate.e_score_correction_bias, gate.top_k)
                )

            hooks.append(gate.register_forward_hook(_g))
    try:
        logits = model(input_ids=ids, use_cache=False).logits
    finally:
        for h in hooks:
            h.remove()
    res = {}
    pos = torch.arange(T)
    for name, items in rec.items():
        rels = []
        for item in items:
            if name.startswith("indexer"):
                scores, r, k = item  # [B, T, n_entries]
                n_ent = scores.shape[-1]
                valid = torch.arange(n_ent)[None, None, :] < ((pos + 1) // r)[None, :, None]
                valid = valid.expand(B, T, n_ent)
                _, rel = _cut_gaps(scores, valid, k)
            else:
                sc, k = item
                _, rel = _cut_gaps(sc, torch.ones_like(sc, dtype=torch.bool), k)
            rels.append(rel)
        rel = torch.cat(rels)
        res[name] = float(rel.min()) if rel.numel() else float("inf")
    top2 = logits.topk(2, dim=-1).values
    res["argmax"] = float(((top2[..., 0] - top2[..., 1]) / top2[..., 0].abs().clamp_min(1e-30)).min())
    return res


@torch.no_grad()
def first_near_ties(model, tokens, bound: float = 1e-4) -> np.ndarray:
    """Per batch row, the first position with a near-tie at a top-k cut, computed in float64 (a copy of the model):
    a CSA indexer cut (k-th vs (k+1)-th causally valid score) or a score-routed MoE cut (on sqrtsoftplus /
    sigmoid(logits) + bias) whose gap is at most `bound` x the larger score (exact ties included, e.g. the
    all-zero scores of few indexer heads). Float32 noise may flip such a choice, and a flip at position p
    changes every later position (its KV), so a parity test compares rows before it. -> [B] int (T: none)."""
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as M

    m = copy.deepcopy(model).double()
    m.config._experts_implementation = "eager"  # grouped_mm has no float64 kernel
    ids = _ids(tokens)
    B, T = ids.shape
    first = np.full(B, T)
    pos = torch.arange(T)

    def record(scores: torch.Tensor, valid: torch.Tensor, k: int):
        s = scores.masked_fill(~valid, float("-inf"))
        if s.shape[-1] <= k:
            return
        top = s.topk(k + 1, dim=-1).values
        a, b = top[..., k - 1], top[..., k]
        tie = torch.isfinite(b) & ((a - b) <= bound * torch.maximum(a.abs(), b.abs()))
        for row in range(B):
            at = torch.nonzero(tie[row]).flatten()
            if len(at):
                first[row] = min(first[row], int(at[0]))

    hooks = []
    for layer in m.model.layers:
        comp = getattr(layer.self_attn, "compressor", None)
        if isinstance(comp, M.DeepseekV4CSACompressor):
            idx = comp.indexer

            def _h(mod, args, out, idx=idx):
                n = out.shape[-1]
                valid = torch.arange(n)[None, None, :] < ((pos + 1) // idx.compress_rate)[None, :, None]
                record(out, valid.expand(B, T, n), idx.index_topk)

            hooks.append(idx.scorer.register_forward_hook(_h))
        gate = layer.mlp.gate
        if isinstance(gate, M.DeepseekV4TopKRouter):

            def _g(mod, args, out, gate=gate):
                sc = (gate.score_fn(out[0]) + gate.e_score_correction_bias).reshape(B, T, -1)
                record(sc, torch.ones_like(sc, dtype=torch.bool), gate.top_k)

            hooks.append(gate.register_forward_hook(_g))
    try:
        m(input_ids=ids, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return first


def check_no_near_ties(model, tokens, tol: float = 1e-5) -> dict[str, float]:
    """Assert every indexer / router top-k cut and every logits argmax has relative margin > tol."""
    m = discrete_margins(model, tokens)
    bad = {k: v for k, v in m.items() if not v > tol}
    assert not bad, f"near-ties (relative margin <= {tol}): {bad}"
    return m


# ----------------------------------------------------------------------------------------------
# Self-check: python tests/hf_oracle.py
# ----------------------------------------------------------------------------------------------


def _selfcheck(B: int = 2, T: int = 220, n_new: int = 12, seed: int = 0):  # pragma: no cover
    import tempfile
    import time

    t0 = time.perf_counter()
    cfg = hf_tiny_config()
    model = build_hf_model(cfg, seed=seed)
    t1 = time.perf_counter()
    rng = np.random.default_rng(1234)
    tokens = rng.integers(2, cfg.vocab_size, size=(B, T))
    lg = hf_logits(model, tokens)
    t2 = time.perf_counter()
    print(f"build {t1 - t0:.3f}s  forward B={B} T={T}: {t2 - t1:.3f}s  logits {lg.shape} finite={np.isfinite(lg).all()}")
    print(f"logit std {lg.std():.3f}  max|.| {np.abs(lg).max():.3f}")
    lg_c = hf_logits(model, tokens, use_cache=True)
    print("one-shot cached vs uncached max|d|:", float(np.abs(lg_c - lg).max()))
    print("margins:", json.dumps(discrete_margins(model, tokens), indent=None))
    t3 = time.perf_counter()
    inc = hf_prefill_decode_logits(model, tokens, n_prefill=T - 37)
    t4 = time.perf_counter()
    print(f"prefill {T - 37} + 37 decodes vs full: max|d| {np.abs(inc - lg).max():.3e}  ({t4 - t3:.2f}s)")
    g, glog = hf_greedy(model, tokens, n_new, return_logits=True)
    t5 = time.perf_counter()
    ref = hf_greedy_reference(model, tokens, n_new)
    t6 = time.perf_counter()
    print(f"generate {g.shape} ({t5 - t4:.2f}s) == cache-free greedy: {np.array_equal(g, ref)} ({t6 - t5:.2f}s)")
    top2 = np.sort(glog, axis=-1)[..., -2:]
    print("greedy step min relative top1-top2 margin:", float(((top2[..., 1] - top2[..., 0]) / np.abs(top2[..., 1])).min()))
    full = hf_logits(model, np.concatenate([tokens, g], axis=1))
    print("generate step logits vs full forward max|d|:", float(np.abs(glog - full[:, T - 1 : T - 1 + n_new]).max()))
    with tempfile.TemporaryDirectory() as d:
        from transformers import DeepseekV4ForCausalLM

        for mode in ("hf", "orig", "official"):
            dd = os.path.join(d, mode)
            if mode == "official":
                names = save_official_checkpoint(model, dd)
            else:
                names = save_hf_model(model, dd, original_format=(mode == "orig"))
            with _quiet_transformers():
                m2, info = DeepseekV4ForCausalLM.from_pretrained(dd, dtype=torch.float32, output_loading_info=True)
            m2.eval()
            same = all(torch.equal(v, m2.state_dict()[k]) for k, v in model.state_dict().items())
            d2 = float(np.abs(hf_logits(m2, tokens) - lg).max())
            miss = {k: sorted(v) for k, v in info.items() if v}
            print(f"save[{mode}]: {len(names)} tensors, reload bitwise-equal={same} issues={miss} logits max|d| {d2:.3e}")


if __name__ == "__main__":  # pragma: no cover
    _selfcheck()
