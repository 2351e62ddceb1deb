"""The parity matrix: every layout plait has, at world 1/2/4, in fp32 and bf16, against the
single-device run of the same precision. The central numerics promise of plait.

All runs share the seed, the data order and one thread per rank, so any difference comes from
the layout itself. Each row states its tolerance and why it holds; the matrix is printed in
pytest's summary, so a reviewer (and CI's log) sees the measured numbers, not just a pass.
"""

import pytest

from conftest import (AUTOCAST, BF16, LAYOUTS, REFERENCE, REPORTS, eval_scores, layout_run, losses,
                      scores_the_task, val_losses)

pytestmark = pytest.mark.slow

# Averaging two fp32 gradients is exact in either order ((a+b)/2 = a/2 + b/2), and the single
# device accumulates the same two slices: every world-2 data-parallel layout is bitwise.
BITWISE = 0.0
# Four gradients sum in backend-specific orders, and TP splits each row-wise matmul's reduction
# into two partial sums: last-bit differences in fp32, measured 4.8e-7 for every such row.
FP32_REORDERED = 1e-6
TIED_REORDERED = 2e-6  # two fp32 ulps of a loss in [8, 16): see the tied rows
MOE_REORDERED = 2e-6  # four ulps of a loss in [4, 8): see the mixtures of experts' rows
# bf16 compute: a last-bit difference in an fp32 master weight can flip its bf16 rounding, and
# TP sums two bf16-rounded partial products where one device rounds once: bf16 resolution of
# the activations. It depends on the CPU's bf16 kernels: measured up to 4.1e-4 on an AMX CPU,
# 3.7e-4 on an AVX2 CPU (emulated bf16), 3.0e-4 with oneDNN capped at AVX2; bound 2.5x the worst.
BF16_REORDERED = 1e-3

# Context parallelism gives each query row the same keys in the same order as one device, but
# its query blocks (a rank's two chunks) end where one device's do not, and each key's dK/dV is
# the sum of two ranks' partials, which one device's kernel accumulates in one loop: last-bit
# differences in fp32, measured at most 4.8e-7 in every cp row (1 ulp of a loss in [4, 8)). Its bf16 row: one, the mechanism is the same in the others.
CONTEXT = ("cp", "cp_causal", "cp_fsdp2", "cp_tp", "pp_cp", "cp_fsdp2_tp",
           "cp_ulysses", "cp_ulysses_causal", "cp_ulysses_fsdp2", "cp_ulysses_tp", "pp_cp_ulysses", "cp_hybrid")
CONTEXT_BF16 = ("cp", "cp_ulysses")
# Float8 against the single device with the same recipe (FLOAT8_BOUNDS below).
FLOAT8 = ("fsdp2_f8", "ddp_f8", "classic_ddp_f8", "tp_f8", "pp_f8", "fsdp2_tp_f8", "fsdp2_f8_rowwise", "tp_f8_rowwise")
FLOAT8_BF16 = ("fsdp2_f8",)
# Llama's relatives (conftest: Qwen3's per-head q/k norm, tied; Qwen2's biases; OLMo 2's norms),
# in both precisions but OLMo 2 (fp32: its norm split by TP is the new mechanism).
# The switches change no reduction: FSDP2 and the pipeline are bitwise as for Llama, TP adds
# one more split sum per q/k norm (projection) and none for biases (each rank adds its own
# columns' bias; wo's is added once, after the sum). OLMo 2 normalises each sub-layer's output,
# whose scale at init is ~0.02: a last-bit difference in it comes out of the norm ~50x larger
# relative to the residual stream than in a block that normalises its input, measured 1.9e-6
# (4 ulps of a loss in [4, 8)) in fp32: POST_NORM is 5x that.
POST_NORM = 1e-5
# A tied model's embedding starts at the output layer's scale (std dim^-0.5, not 1): its residual
# stream starts ~11x smaller, so each sub-layer's bf16-rounded output weighs ~11x more against it.
# TP2 in bf16 measured 1.4e-3 (Qwen3 shape) and 1.9e-3 (Llama's tied debug model, not a row);
# bound 2.6x the worst.
TIED_BF16 = 5e-3
# Sliding windows (debug_sliding: Qwen3-shaped, a window of 8 on its second block) change which
# keys a query meets, not how any sum is split: FSDP2 and the pipeline are bitwise, all-gather CP
# (each query block's keys from its window on; only the chunks' tails gathered) measured 4.8e-7
# (1 ulp of a loss in [4, 8)), Ulysses 9.5e-7 (2 ulps: bound 4). TP2 reorders the Qwen3 shape's
# sums (attention 256 wide over a width of 128: wo's row-wise split halves sums twice as long as
# the Llama debug model's), measured 1.4e-6 (3 ulps): bound 8.
SLIDING_ULYSSES, SLIDING_TP = 2e-6, 4e-6
# OLMo 3 (debug_olmo3: OLMo 2's norms, a sliding block then a full one, each block kind with its
# own RoPE table): FSDP2 and the pipeline bitwise, TP2 and CP2 9.5e-7 (2 ulps: bound 4,
# OLMO3_REORDERED). Of the families added with it, only Llama 4's EP2 (its experts weighed on
# their inputs, a new mechanism in bf16) has a bf16 row: each FSDP2 run measured bitwise in bf16
# too (by hand), the mechanism the Qwen and sliding rows already hold, and a bf16 run costs an
# AVX2 CPU minutes. No bf16 TP or CP rows, as for OLMo 2: the post-norm's
# amplification (above) meets bf16 rounding, TP2 1.5e-3 and CP2 2.5e-3 in the loss, and under TP2
# the task's acc (an argmax over 4 examples' scores) flipped: a row would test the task's margins.
OLMO3_REORDERED = 2e-6
# Gemma 3 (debug_gemma3: norms before and after each sub-layer, zero-centred; tied; RoPE by block
# kind): FSDP2 bitwise, CP2 3.6e-7 (a validation loss; on an AVX2 CPU 1.9e-6, and 2.0e-6 a
# validation loss); TP2 1.4e-6 and 2.9e-6 (a validation loss): the post-norms' amplification on
# a tied model, bound POST_NORM for both. No bf16 TP or
# CP rows, as for OLMo: measured 3.2e-3 and 1.3e-3.
# Qwen3-Next (debug_hybrid: a linear-attention block, the gated delta rule in chunks of 16 over
# 64-token sequences, then a gated full-attention block; debug_hybrid_moe with experts and a gated
# shared expert): the rule runs per sequence and per head in fp32, so data parallelism and the
# pipeline are bitwise (measured, bf16 FSDP2 too, by hand); TP splits its heads and the
# convolution's channels with them, whose only new sum is the output norm's weight gradient over
# the heads: 0 over the rows' 6 steps, 9.5e-7 over 30 at 3e-3 (by hand), bound FP32_REORDERED; bf16
# 1.8e-4 and 3.5e-4 (two runs). EP2 as for the other experts: 0 (fp32), 1.4e-4 (bf16, by hand). CP2 passes each chunk's
# state and convolution window from the chunks before it (plait/parallel/linear_context.py), a chunk's
# output then its zero-state output plus its read of the incoming state: other sums, measured 4.8e-7
# (over 20 steps at 3e-3, by hand: 9.5e-7 CP2, 4.8e-7 CP4, CP2 causal and Ulysses CP2). OLMo hybrid
# under CP2 and FSDP2 at world 4 (its variant changes no sum the layouts split): measured 4.8e-7.
# Kimi Linear (debug_kimi: the rule's gate per key channel, its gates through bottlenecks whole on each
# TP rank, then latent attention without RoPE and experts): the rule's state passes across CP ranks
# as Qwen3-Next's; TP2 measured bitwise (its one new sum: the bottlenecks' weight gradients over
# the ranks' heads, exact at these sizes), EP2 4.8e-7, CP2 with FSDP2 at world 4 9.5e-7 (2 ulps:
# MOE_REORDERED, as the world-4 MoE rows).
FAMILIES = {("cp_fsdp2_olmo_hybrid", "fp32"): FP32_REORDERED,
            ("tp_kimi", "fp32"): FP32_REORDERED, ("ep2_kimi", "fp32"): FP32_REORDERED,
            ("cp_fsdp2_kimi", "fp32"): MOE_REORDERED,
            ("fsdp2_hybrid", "fp32"): BITWISE, ("pp_hybrid", "fp32"): BITWISE, ("cp2_hybrid", "fp32"): FP32_REORDERED,
            ("tp_hybrid", "fp32"): FP32_REORDERED, ("tp_hybrid", "bf16"): BF16_REORDERED,
            ("ep2_hybrid_moe", "fp32"): FP32_REORDERED,
            ("fsdp2_qwen3_tied", "fp32"): BITWISE, ("fsdp2_qwen3_tied", "bf16"): BITWISE,
            ("tp_qwen3_tied", "fp32"): TIED_REORDERED, ("tp_qwen3_tied", "bf16"): TIED_BF16,
            ("fsdp2_qwen2", "fp32"): BITWISE, ("fsdp2_qwen2", "bf16"): BITWISE,
            ("tp_qwen2", "fp32"): FP32_REORDERED, ("tp_qwen2", "bf16"): BF16_REORDERED,
            ("pp_qwen2", "fp32"): BITWISE, ("pp_qwen2", "bf16"): BITWISE,
            ("tp_olmo2", "fp32"): POST_NORM,
            ("fsdp2_olmo3", "fp32"): BITWISE, ("pp_olmo3", "fp32"): BITWISE,
            ("tp_olmo3", "fp32"): OLMO3_REORDERED, ("cp_olmo3", "fp32"): OLMO3_REORDERED,
            ("fsdp2_gemma3", "fp32"): BITWISE,
            ("tp_gemma3", "fp32"): POST_NORM, ("cp_gemma3", "fp32"): POST_NORM,
            ("fsdp2_sliding", "fp32"): BITWISE, ("fsdp2_sliding", "bf16"): BITWISE, ("pp_sliding", "fp32"): BITWISE,
            ("tp_sliding", "fp32"): SLIDING_TP, ("tp_sliding", "bf16"): BF16_REORDERED,
            ("cp_sliding", "fp32"): FP32_REORDERED, ("cp_ulysses_sliding", "fp32"): SLIDING_ULYSSES}
FAMILY_ROWS = {name for name, _ in FAMILIES}
# Mixtures of experts (conftest: debug_moe's rows), against the single device forwarding the same
# sequences together (their load-balancing loss is per forward). Routing is the same in every
# row: the router scores in fp32 and the top k are picked by a stable sort (ties to the lower
# expert), and a last-bit difference in a score moves no choice in these runs. SimpleFSDP is
# bitwise, as for Llama. EP gives an expert every token of its ep group in one grouped matmul and
# sums its weight gradient over them at once, where one device sums each micro-batch's part and
# then the two; TP runs every expert whole on every rank and reorders the attention's sums as in
# the dense rows; CP's ranks route their own chunks and sum the routing's counts for a
# load-balancing loss of the whole sequences. Measured in fp32: 4.8e-7 (EP2, PP2+EP2, CP2,
# CP2+EP2, sigmoid router) and 9.5e-7 (TP2, EP2+FSDP2, EP2+HSDP, EP2+TP2): up to 2 ulps of a loss in
# [4, 8) where the dense rows measure 1: the rows that measure 1 ulp keep FP32_REORDERED, those
# that measure 2 get 4 ulps, MOE_REORDERED (Muon's TP rows below: the same margin). bf16 (EP2): 1.4e-4, the mechanism of BF16_REORDERED.
MLA_TP_BF16 = 3e-3
MOE_BOUNDS = {("simple_fsdp_moe", "fp32"): BITWISE,  # (measured: data parallelism as for Llama)
              # a pipeline forwards single_moe's micro-batches, each stage its own layers: as for Llama
              ("pp_moe", "fp32"): BITWISE, ("pp_moe_sigmoid", "fp32"): BITWISE,
              **{(name, "fp32"): FP32_REORDERED for name in ("ep2_moe", "pp_ep2_moe", "cp_moe", "cp_ep2_moe",
                                                             "ep2_moe_sigmoid")},
              **{(name, "fp32"): MOE_REORDERED for name in ("tp_moe", "ep2_fsdp2_moe", "ep2_hsdp_moe", "ep2_tp2_moe",
                                                            "cp_ulysses_moe")},  # (Ulysses CP2: measured 9.5e-7)
              ("ep2_moe", "bf16"): BF16_REORDERED,
              # gpt-oss (debug_gpt_oss: sinks, windows, biased experts and router, the clamped SwiGLU):
              # the same mechanisms, measured bitwise (FSDP2 fp32 and bf16, PP2), 4.8e-7 (EP2), 6.0e-7
              # (CP2) and 9.5e-7 (TP2)
              ("fsdp2_gpt_oss", "fp32"): BITWISE, ("fsdp2_gpt_oss", "bf16"): BITWISE, ("pp_gpt_oss", "fp32"): BITWISE,
              ("ep2_gpt_oss", "fp32"): FP32_REORDERED, ("cp_gpt_oss", "fp32"): MOE_REORDERED,
              ("tp_gpt_oss", "fp32"): MOE_REORDERED,
              # DeepSeek-V3 (debug_mla: latent attention, grouped sigmoid routing, a shared expert,
              # multi-token prediction, the sequence-wise balance loss): FSDP2 (fp32 and
              # bf16; the MTP loss too) measured bitwise, EP2 and CP2 4.8e-7 (the MTP loss too: CP
              # shifts its targets on the whole sequence), PP2 4.8e-7 (MTP on the last stage with a
              # copy of the embedding: the two stages' embedding gradients summed by all-reduce,
              # where one device's autograd adds them in its own order; the MTP loss bitwise), CP2 bf16 2.2e-4 (each
              # key latent's gradient sums two ranks' bf16 partials). TP keeps the latents whole on
              # each rank and completes their weights' gradients over TP, a partial sum per rank: in
              # fp32 the reordering of TP's other sums (9.5e-7, the MTP loss too); in bf16 each rank's
              # partial gradient of every latent is rounded to bf16 before the sum, where one device
              # rounds the whole once: measured 1.7e-4 (9.6e-4 without the balance loss and MTP),
              # bound 3e-3 (MLA_TP_BF16).
              ("fsdp2_mla", "fp32"): BITWISE, ("fsdp2_mla", "bf16"): BITWISE, ("pp_mla", "fp32"): FP32_REORDERED,
              ("ep2_mla", "fp32"): FP32_REORDERED,
              ("cp_mla", "fp32"): FP32_REORDERED, ("cp_mla", "bf16"): BF16_REORDERED,
              ("ep2_fsdp2_mla", "fp32"): MOE_REORDERED,  # (world 4: 4.8e-7, the loss and the MTP loss)
              ("hsdp_mla", "fp32"): MOE_REORDERED,
              ("tp_mla", "fp32"): MOE_REORDERED, ("tp_mla", "bf16"): MLA_TP_BF16,
              ("fsdp2_mla_f8", "fp32"): BITWISE,  # (float8 as for fsdp2_f8: scales over the same values)
              # GLM-4.5 (debug_glm4_moe: DeepSeek-V3's router on grouped-query attention with biases, q/k
              # norms and RoPE on half of each head): the same mechanisms, measured bitwise (FSDP2 fp32
              # and bf16, PP2), 4.8e-7 (TP2, EP2) and 9.5e-7 (CP2); bf16 EP2 2.3e-4 (by hand: above)
              ("fsdp2_glm4_moe", "fp32"): BITWISE,
              ("pp_glm4_moe", "fp32"): BITWISE, ("tp_glm4_moe", "fp32"): FP32_REORDERED,
              ("ep2_glm4_moe", "fp32"): FP32_REORDERED,
              ("cp_glm4_moe", "fp32"): MOE_REORDERED,
              # Llama 4 (debug_llama4: experts weighed on their inputs, an unbiased sigmoid router, a
              # block without RoPE whose queries are temperature-tuned, L2 q/k norms): measured bitwise
              # (FSDP2 fp32 and bf16, PP2), 4.8e-7 (TP2, EP2) and 9.5e-7 (CP2: the temperature taken
              # by position on each rank's chunks); bf16 EP2 1.2e-4
              ("fsdp2_llama4", "fp32"): BITWISE, ("pp_llama4", "fp32"): BITWISE,
              ("tp_llama4", "fp32"): FP32_REORDERED, ("ep2_llama4", "fp32"): FP32_REORDERED,
              ("ep2_llama4", "bf16"): BF16_REORDERED, ("cp_llama4", "fp32"): MOE_REORDERED}
# Muon against the single device with Muon. Each matrix is orthogonalised whole in fp32 from the
# same momentum, by the same kernels, wherever it meets: data parallelism (every backend, the
# matrices spread over the shard ranks by all-to-all) and the pipeline are bitwise in fp32 as
# under AdamW; TP and the world-4 rows reorder the gradients' sums as under AdamW, and an
# orthogonalised update is as sensitive to a last bit as AdamW's: measured 4.8e-7 (FSDP2 world 4,
# HSDP) and 9.5e-7 (TP2, FSDP2+TP2: bound MOE_REORDERED). bf16: the mechanism of BF16_REORDERED,
# measured 1.5e-4 (TP2) and 1.8e-4 (FSDP2+TP2).
MUON_BOUNDS = {**{(name, "fp32"): BITWISE for name in ("fsdp2_muon", "ddp_muon", "classic_ddp_muon",
                                                       "simple_fsdp_muon", "pp_muon")},
               **{(name, "fp32"): FP32_REORDERED for name in ("fsdp2_w4_muon", "hsdp_muon")},
               **{(name, "fp32"): MOE_REORDERED for name in ("tp_muon", "fsdp2_tp_muon")},
               ("fsdp2_muon", "bf16"): BITWISE, ("tp_muon", "bf16"): BF16_REORDERED}  # (FSDP2+TP bf16: fsdp2_tp's)
# Every layout without a pipeline or cp (the tied model's rows are fp32: what tying changes is
# which parameter each wrapper holds, not the arithmetic bf16 rows check).
SPMD = [name for name in LAYOUTS
        if not name.startswith(("pp", "single")) and not name.endswith("tied") and "moe" not in name
        and "muon" not in name and "gpt_oss" not in name and "mla" not in name and "llama4" not in name
        and not name.endswith("_mx") and name not in (*CONTEXT, *FLOAT8, *FAMILY_ROWS)]
# bf16 rows: every such layout's but SimpleFSDP's with TP at world 4, whose bf16 mechanism (TP's split
# sums) fsdp2_tp and ddp_tp hold (their fp32 rows stay): a world-4 bf16 run costs an AVX2 CPU, which
# emulates bf16, the most of any row.
SPMD_BF16 = [name for name in SPMD if name not in ("simple_ddp_tp", "simple_fsdp_tp")]
WORLD2_DP = ("ddp", "fsdp2", "classic_ddp", "simple_fsdp", "simple_ddp")
# A pipeline without data parallelism computes each micro-batch as the single device does and
# accumulates the weight gradients in the same ascending order (all scaling inside the loss):
# measured bitwise in fp32 for every schedule, and in bf16 for 1f1b. The zero-bubble schedules
# compute weight gradients apart from input gradients: bf16 rounds differ, measured 1.9e-4.
PIPELINES = ("pp", "pp_gpipe", "pp_interleaved_1f1b", "pp_interleaved_zb", "pp_zbv")
# bf16 rows of pipelines: one per mechanism (schedule kinds, + data, + tensor parallelism); the
# other schedules' bf16 runs would repeat what these show at the price of emulated bf16 on AVX2.
PIPELINES_BF16 = {"pp": BITWISE, "pp_zbv": BF16_REORDERED, "pp_fsdp2": BF16_REORDERED, "pp_tp": BF16_REORDERED}
# Float8 rows: every float8 scale is taken over the same values as on one device (FSDP2's
# float8 all-gather uses scales from every shard's amax, all-reduced once after each optimizer
# step; TP's DTensors reduce a sharded tensor's amax), so data parallelism (classic DDP too) and
# pipelines are bitwise in fp32, rowwise too. TP reorders fp32 sums, and a last-bit change in an
# activation can move it across a float8 rounding boundary (3 mantissa bits: 16x coarser than
# bf16): measured 2.9e-5 (TP2), 7.3e-5 (TP2 rowwise), 2.9e-5 (FSDP2+TP2; 1.7e-4 while each
# gather all-reduced its own amax). In bf16 FSDP2 casts each fp32 shard straight to float8
# where the single device casts its bf16 copy of the weight (param mode) to float8: two
# roundings instead of one, measured 3.6e-4. Bound: BF16_REORDERED's 1e-3 for both (the same
# mechanism, a low-precision rounding flipped), at least 2.8x the worst. (Float8 against no
# float8 is 1.7e-4 on one device, below that bound: the dtype probe, not parity, proves that
# float8 runs in every row.)
FLOAT8_BOUNDS = {**{(name, "fp32"): BITWISE for name in ("fsdp2_f8", "ddp_f8", "classic_ddp_f8", "pp_f8",
                                                          "fsdp2_f8_rowwise")},
                 **{(name, "fp32"): BF16_REORDERED for name in ("tp_f8", "fsdp2_tp_f8", "tp_f8_rowwise")},
                 ("fsdp2_f8", "bf16"): BF16_REORDERED}
# MXFP8 rows (emulated: each block of 32 cast to e4m3 with a power-of-two scale, multiplied in the
# compute dtype): FSDP2 gathers whole weights and the pipeline splits whole layers, so both are
# bitwise (fp32 and bf16). CP2 (fp32) trains bitwise over 6 steps, though its ranks' weight-gradient
# blocks of 32 tokens group other tokens than one device's; its validation loss, summed over the
# sequence's shards in another order, measured 4.8e-7: bound TP's (below). TP's shards hold whole
# blocks, but TP reorders fp32 sums, and a last bit can move a value across an e4m3 rounding
# boundary, float8's TP mechanism: measured 4.8e-7
# (val 1.2e-6; FSDP2+TP2 4.8e-7), bound float8's TP rows' 1e-3 (they measured up to 7.3e-5 where a
# rounding flipped).
# In bf16, TP, EP2 and EP2+FSDP2 (experts in MXFP8, each expert's tokens padded to whole blocks in
# every layout) measured 4.8e-4, 3.5e-4 and 4.4e-4: bf16's reordering seen through e4m3's coarser
# rounding, bound MXFP8_BF16 (4x the worst). fp32 EP rows keep the experts in fp32 (MXFP8's grouped
# matmul is bf16-only) and reorder sums as without MXFP8; a reordered last bit can then flip an
# e4m3 rounding of the dense layers, as under TP: measured 4.8e-7 (EP2), 2.1e-5 (EP2+FSDP2, world
# 4), bound float8's TP rows' 1e-3 for both.
MXFP8_BF16 = 2e-3
MXFP8_BOUNDS = {("fsdp2_mx", "fp32"): BITWISE, ("fsdp2_mx", "bf16"): BITWISE, ("pp_mx", "fp32"): BITWISE,
                ("cp_mx", "fp32"): BF16_REORDERED,
                ("tp_mx", "fp32"): BF16_REORDERED, ("tp_mx", "bf16"): MXFP8_BF16,
                ("fsdp2_tp_mx", "fp32"): BF16_REORDERED,
                ("ep2_moe_mx", "fp32"): BF16_REORDERED, ("ep2_fsdp2_moe_mx", "fp32"): BF16_REORDERED,
                ("ep2_moe_mx", "bf16"): MXFP8_BF16}  # (EP2+FSDP2 bf16 measured 4.4e-4: EP2's mechanism, no row)
TOLERANCE = {  # (layout, precision): tolerance against the single device
    **{(name, "fp32"): BITWISE for name in WORLD2_DP},
    **{(name, "bf16"): BITWISE for name in WORLD2_DP},
    ("tp", "fp32"): FP32_REORDERED, ("tp", "bf16"): BF16_REORDERED,
    **{(name, "fp32"): FP32_REORDERED for name in ("hsdp_w4", "simple_hsdp_w4")},
    **{(name, "fp32"): FP32_REORDERED for name in ("ddp_tp", "fsdp2_tp", "simple_ddp_tp", "simple_fsdp_tp")},
    **{(name, "bf16"): BF16_REORDERED for name in LAYOUTS if LAYOUTS[name][0] == 4 and name in SPMD_BF16},
    **{(name, "fp32"): BITWISE for name in PIPELINES},
    **{(name, "fp32"): FP32_REORDERED for name in ("pp_fsdp2", "pp_ddp", "pp_tp", "pp_fsdp2_tp")},
    **{(name, "bf16"): tolerance for name, tolerance in PIPELINES_BF16.items()},
    # FSDP2 holds the tied matrix as one parameter whose gradient autograd sums before the
    # reduce-scatter, as one device sums it: bitwise. SimpleFSDP gathers it once per use and
    # reduce-scatters each use's gradient, then adds the two averages: ((a1+a2)+(b1+b2))/2 vs
    # (a1+b1)/2+(a2+b2)/2; TP splits the sums as for the untied model. The tied model's losses
    # (~10.9) lie in [8, 16), where one fp32 ulp is 9.5e-7: both measured exactly one ulp,
    # so the bound is two (FP32_REORDERED, one ulp of the untied losses in [4, 8), would be one).
    ("fsdp2_tied", "fp32"): BITWISE, ("simple_fsdp_tied", "fp32"): TIED_REORDERED, ("tp_tied", "fp32"): TIED_REORDERED,
    **{(name, "fp32"): FP32_REORDERED for name in CONTEXT},
    **{(name, "bf16"): BF16_REORDERED for name in CONTEXT_BF16},
    **FLOAT8_BOUNDS,
    **MXFP8_BOUNDS,
    **FAMILIES,
    **MOE_BOUNDS,
    **MUON_BOUNDS,
}
PRECISIONS = {"fp32": [], "bf16": BF16}
# The task's scores (plait/evals) come from batches as long as their longest request, but a
# pipeline's are seq_len long (its stages exchange tensors of one shape): attention then runs
# over more (masked) keys, in other blocks, and a per-token log-probability can move by its last
# bit, in fp32 or (in bf16) in a bf16 rounding. Measured 7.0e-9 and 9.2e-9 (fp32), 6.1e-7 and
# 1.3e-6 (bf16): bounded by the mechanisms' FP32_REORDERED and BF16_REORDERED.
PADDED = {"fp32": FP32_REORDERED, "bf16": BF16_REORDERED}


def mode(name: str, precision: str) -> list[str]:
    """Classic DDP cannot cast parameters, so its bf16 run (and its reference) is autocast."""
    return AUTOCAST if name == "classic_ddp" and precision == "bf16" else []


@pytest.fixture(scope="module")
def matrix(train_once):
    """(layout, world, precision, max loss difference, tolerance, ...) per row. The difference
    is over the 6 training losses, the 2 validation losses (after steps 3 and 6; none under zbv)
    and the bundled task's gold_loss at those steps in the rows of debug's own model (conftest's
    TASK; plait/evals: its 4 examples' gold choices' loss per token, scored in the layout's own
    batches): each is a forward of the same weights, so the same tolerance bounds it (a
    pipeline's scores: PADDED). The task's acc (an argmax of those scores) must be equal."""
    table = []
    for (name, precision), tolerance in TOLERANCE.items():
        reference = layout_run(train_once, REFERENCE[name], PRECISIONS[precision], mode(name, precision))[0]
        measured = layout_run(train_once, name, PRECISIONS[precision], mode(name, precision))[0]
        assert len(measured) == len(reference) and reference[-1]["loss"] < reference[0]["loss"], (name, precision)
        expected_val = 0 if name == "pp_zbv" else 2
        assert (len(val_losses(measured)), len(val_losses(reference))) == (expected_val, 2), (name, precision)
        diff = max(abs(a - b) for a, b in zip(losses(measured), losses(reference)))
        val_diff = max((abs(a - b) for a, b in zip(val_losses(measured), val_losses(reference))), default=None)
        scored, expected = eval_scores(measured), eval_scores(reference)
        task = scores_the_task(LAYOUTS[name][1])
        assert (len(scored), len(expected)) == (expected_val * task, 2 * task), (name, precision)
        eval_diff = max((abs(a[0] - b[0]) for a, b in zip(scored, expected)), default=None)
        eval_tolerance = max(tolerance, PADDED[precision]) if name.startswith("pp") else tolerance
        ok = (max(diff, val_diff or 0) <= tolerance and (eval_diff or 0) <= eval_tolerance
              and all(a[1] == b[1] for a, b in zip(scored, expected)))
        table.append((name, LAYOUTS[name][0], precision, ok, tolerance, diff, val_diff, eval_diff, eval_tolerance))
    lines = ["layout           world  precision  max |loss - single|  max |val_loss - single|  tolerance  "
             "max |task gold_loss - single|  tolerance"]
    lines += [f"{name:<16} {world:>5}  {precision:<9}  {diff:>19.2e}  "
              f"{'-' if val_diff is None else f'{val_diff:.2e}':>23}  {tolerance:>9.0e}  "
              f"{'-' if eval_diff is None else f'{eval_diff:.2e}':>29}  {eval_tolerance:>9.0e}  {'ok' if ok else 'FAIL'}"
              for name, world, precision, ok, tolerance, diff, val_diff, eval_diff, eval_tolerance in table]
    REPORTS["parity matrix: max |loss - single device| over 6 steps, of the 2 validation losses, and of the task "
            "scores (FAIL also where the task's acc differs)"] = "\n".join(lines)
    return table


def test_every_layout_matches_the_single_device(matrix):
    failures = [(name, precision, diff, val_diff, eval_diff)
                for name, _, precision, ok, _, diff, val_diff, eval_diff, _ in matrix if not ok]
    assert not failures, failures


def test_the_matrix_covers_every_layout_at_world_1_2_4_8(matrix):
    """Every layout in fp32; in bf16 every layout without a pipeline or cp, one pipeline per
    mechanism, cp alone, and the Qwen-shaped rows."""
    rows = {(name, precision) for name, _, precision, *_ in matrix}
    assert rows == {(name, "fp32") for name in LAYOUTS if not name.startswith("single")} | \
        {(name, "bf16") for name in [*SPMD_BF16, *PIPELINES_BF16, *CONTEXT_BF16, *FLOAT8_BF16]} | \
        {row for row in {**FAMILIES, **MOE_BOUNDS, **MUON_BOUNDS, **MXFP8_BOUNDS} if row[1] == "bf16"}
    assert {world for _, world, *_ in matrix} | {LAYOUTS["single"][0]} == {1, 2, 4, 8}
