# Block-sparse attention backward: dQ, dK, dV and the gradients of the score_mod's captured tensors.
#
# Three kernels, launched in this order:
#   backward_preprocess  Delta[i] = rowsum(dO[i] * O[i]) - dLSE[i]      (one program per query tile)
#   backward_dkdv        one program per (KV tile, batch x KV head): walks the query tiles that see
#                        its KV tile (the transposed block mask: Q_NUM_BLKS / Q_IDX, then the full
#                        twins), for every query head of its GQA group, accumulating dK and dV
#   backward_dq          one program per (query tile, batch x query head): walks KV tiles like the
#                        forward and accumulates dQ; it also scatters captured-tensor gradients
#
# P is recomputed from Q, K and the saved LSE (no [L, L] tensor is ever stored). With
# s = score_mod(q.k * SM_SCALE) and P = exp(s - LSE):
#   dV  = P^T dO
#   dP  = dO V^T
#   dS  = P * (dP - Delta)            gradient w.r.t. the modified score s; Delta includes -dLSE
#                                     because d LSE / d s = P
#   dS' = dS * d score_mod / d score  (score_mod_grad: the symbolic derivative, emitted from the IR)
#   dQ  = dS' K * SM_SCALE,   dK = dS'^T Q * SM_SCALE
#
# sub notation:
#   Q, DQ           [B, HQ, Q_LEN, QK_HEAD_DIM]
#   K, V            [B or 1, HKV, KV_LEN, QK_HEAD_DIM / V_HEAD_DIM]   (batch 1: the host passes stride 0)
#   DK, DV          [B, HKV, KV_LEN, ...]: one slice per *query* batch (the host sums over the batch
#                   when K/V broadcast)
#   Out, DO         [B, HQ, Q_LEN, V_HEAD_DIM]
#   LSE             [B, HQ, Q_LEN], natural log, -inf for rows that see nothing
#   DLSE            [B, HQ, Q_LEN] gradient of LSE (only read when HAS_GRAD_LSE)
#   DELTA           [B, HQ, Q_LEN] float32/64, written by backward_preprocess
#   KV_NUM_BLKS, KV_IDX, FULL_KV_NUM_BLKS, FULL_KV_IDX   [Bm, Hm, nQ(, nKV)] as in the forward (dQ)
#   Q_NUM_BLKS, Q_IDX, FULL_Q_NUM_BLKS, FULL_Q_IDX       [Bm, Hm, nKV(, nQ)] the transposed lists:
#                   the query blocks that see each KV block (dK/dV); Bm, Hm broadcast by stride 0
#   G{i}            float32/64 gradient buffer of captured tensor i (zeroed by the host; atomics), or
#                   in deterministic mode its exact sums (int64 [*shape, 3]: _fa_atomic_add_exact)
#   SM_SCALE        runtime float
#
# constexprs:
#   BLOCK_M1, BLOCK_N1     dK/dV pass: query rows per inner step / KV rows per program
#   BLOCK_M2, BLOCK_N2     dQ pass: query rows per program / KV columns per inner step
#   SPARSE_Q_BLOCK_SIZE    query rows per block-mask block (a multiple of BLOCK_M1 and BLOCK_M2)
#   SPARSE_KV_BLOCK_SIZE   KV columns per block-mask block (a multiple of BLOCK_N1 and BLOCK_N2)
#   QK_HEAD_DIM, V_HEAD_DIM             real head dims (E, Ev)
#   QK_HEAD_DIM_ROUNDED, V_HEAD_DIM_ROUNDED  next powers of two (>= 16)
#   SAFE_HEAD_DIM          both head dims are powers of two: no column masks
#   IS_DIVISIBLE           Q_LEN and KV_LEN fill whole sparse blocks (and tiles): no bounds checks
#   GQA_SHARED_HEADS       query heads per KV head; query head h reads KV head h // GQA_SHARED_HEADS
#   HAS_FULL_BLOCKS        the FULL_* lists exist
#   HAS_GRAD_LSE           the caller's loss used the returned LSE: Delta -= dLSE
#   BLOCKS_ARE_CONTIGUOUS  each list's blocks are consecutive (no indirect jumps)
#   OFFS_INT64             some tensor spans more than 2^31 elements: int64 tile offsets
#   ACC_DTYPE              float32 (float64 for float64 inputs): scores, P, dS, accumulators
#   SCORE_DTYPE            the dtype score_mod was traced with
#   SCORES_IN_BASE2        there is no score_mod (float32 accumulators): P is exp2 of one FMA of the
#                          raw q.k tile, the scale and 1 / ln 2 folded into one factor (p_from_lse)
#   DOT_PRECISION          tl.dot input_precision
#   DOT_IN_FP64            (Triton's interpreter) feed tl.dot float64 copies (see tiles.mma)
#
# Mods (flexattn/codegen/emit.py): score_mod / mask_mod exactly as in the forward;
# score_mod_grad(score, b, h, q_idx, kv_idx, grad, valid, ...) returns where(valid, grad * d mod /
# d score, 0) and, in the dQ pass, atomically adds grad * d mod / d value into G{i} for every
# gather from a captured floating tensor that needs a gradient. The dK/dV pass uses transposed
# tiles: kv_idx is [BLOCK_N1, 1] and q_idx [1, BLOCK_M1] (mods are elementwise, so any layout works).
#
# Both passes recompute P with the same helpers (score_tile, visible, p_from_lse, load_lse_base2,
# below) and differ only in their dots and accumulators; the tile helpers (ptr_offsets, load_tile /
# store_tile, mma, next_start) are tiles.py's, shared with the forward and decoding templates.
$prelude

$score_mod_def

$mask_mod_def

$score_grad_def

$score_dscore_def


$tile_helpers


@triton.jit
def load_rows(ptrs, offs, N, other, IS_DIVISIBLE: tl.constexpr):
    if IS_DIVISIBLE:
        x = tl.load(ptrs)
    else:
        x = tl.load(ptrs, mask=offs < N, other=other)
    return x


@triton.jit
def load_lse_base2(ptrs, offs, N, IS_DIVISIBLE: tl.constexpr):
    # The saved LSE in base 2 for exp2. [Note] fully masked rows have LSE -inf; +inf makes their P
    # exactly 0 (every score of such a row is masked too, so no +inf - +inf can reach a visible
    # element). Rows past N read +inf as well.
    RCP_LN2: tl.constexpr = 1.4426950408889634
    lse = load_rows(ptrs, offs, N, float("inf"), IS_DIVISIBLE)
    return tl.where(lse == float("-inf"), float("inf"), lse * RCP_LN2)


# -- The tile work both passes share. The dQ pass lays tiles out as [query rows, KV columns] (x = q,
# y = k, q_idx [BLOCK_M2, 1], kv_idx [1, BLOCK_N2]); the dK/dV pass transposed (x = k, y = q,
# kv_idx [BLOCK_N1, 1], q_idx [1, BLOCK_M1]). Mods are elementwise, so either layout works.


@triton.jit
def score_tile(
    x, y, b, h, q_idx, kv_idx, SM_SCALE,
    $score_mod_params
    ROWS: tl.constexpr, COLS: tl.constexpr,
    ACC_DTYPE: tl.constexpr, SCORE_DTYPE: tl.constexpr, SCORES_IN_BASE2: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_IN_FP64: tl.constexpr,
):
    # The scaled score tile x @ y^T * SM_SCALE in SCORE_DTYPE (score_mod's derivative reads it
    # again) and the modified score s in ACC_DTYPE. SCORES_IN_BASE2 (no score_mod): both are the
    # raw x @ y^T, and p_from_lse multiplies by the scale.
    qk = mma(x, tl.trans(y), tl.full([ROWS, COLS], 0.0, ACC_DTYPE), DOT_PRECISION, DOT_IN_FP64)
    if SCORES_IN_BASE2:
        s = qk
    else:
        qk = (qk * SM_SCALE).to(SCORE_DTYPE)
        s = score_mod(qk, b, h, q_idx, kv_idx, $score_mod_params).to(ACC_DTYPE)
    return qk, s


@triton.jit
def visible(
    b, h, q_idx, kv_idx, Q_LEN, KV_LEN,
    $mask_mod_params
    IS_FULL_BLOCKS: tl.constexpr, IS_DIVISIBLE: tl.constexpr,
):
    # Where P may be nonzero: mask_mod on partial blocks, and the sequence bounds unless
    # IS_DIVISIBLE says every tile is inside them.
    if IS_FULL_BLOCKS:
        if IS_DIVISIBLE:
            valid = tl.full([1, 1], 1, tl.int1)
        else:
            valid = (q_idx < Q_LEN) & (kv_idx < KV_LEN)
    else:
        valid = mask_mod(b, h, q_idx, kv_idx, $mask_mod_params)
        if not IS_DIVISIBLE:
            valid = valid & (q_idx < Q_LEN) & (kv_idx < KV_LEN)
    return valid


@triton.jit
def p_from_lse(s, SM_SCALE, lse, valid, SCORES_IN_BASE2: tl.constexpr):
    # P = exp(s - LSE) recomputed as exp2(s / ln 2 - lse), lse the saved LSE in base 2 broadcast
    # to the tile's layout; 0 where not valid. SCORES_IN_BASE2: s is the raw q.k, and the scale
    # joins 1 / ln 2 in one factor (exp2 of one FMA per score).
    RCP_LN2: tl.constexpr = 1.4426950408889634
    if SCORES_IN_BASE2:
        x = s * (SM_SCALE * RCP_LN2) - lse
    else:
        x = s * RCP_LN2 - lse
    return tl.where(valid, tl.exp2(x), 0.0)


# ---------------------------------------------------------------------------------------------
# Preprocess


@triton.jit
def backward_preprocess(
$backward_preprocess_params
):
    # Delta of BLOCK_M query rows; ZERO_DQ: also zero those rows of DQ_ACC (the Hopper backward's
    # float32 dQ accumulator, [B, HQ, Q_LEN, QK_HEAD_DIM] with contiguous rows), saving a launch
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // HQ).to(tl.int64)
    h = (pid_bh % HQ).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_v = tl.arange(0, V_HEAD_DIM_ROUNDED)
    rows = offs_m.to(tl.int64)
    o = load_tile(Out + b * stride_oz + h * stride_oh + rows[:, None] * stride_om + offs_v[None, :] * stride_ok,
                  offs_m, offs_v, Q_LEN, V_HEAD_DIM, True, True)
    do = load_tile(DO + b * stride_doz + h * stride_doh + rows[:, None] * stride_dom + offs_v[None, :] * stride_dok,
                   offs_m, offs_v, Q_LEN, V_HEAD_DIM, True, True)
    # (tl.reduce, not tl.sum: the interpreter cannot call standard-library jit functions)
    delta = tl.reduce(o.to(ACC_DTYPE) * do.to(ACC_DTYPE), 1, tl.standard._sum_combine)
    if HAS_GRAD_LSE:
        dlse = tl.load(DLSE + b * stride_dlz + h * stride_dlh + rows * stride_dlm, mask=offs_m < Q_LEN, other=0.0)
        delta -= dlse.to(ACC_DTYPE)
    tl.store(DELTA + pid_bh.to(tl.int64) * Q_LEN + offs_m, delta, mask=offs_m < Q_LEN)
    if ZERO_DQ:
        offs_k = tl.arange(0, QK_HEAD_DIM_ROUNDED)
        tl.store(DQ_ACC + b * stride_dqz + h * stride_dqh + rows[:, None] * stride_dqm + offs_k[None, :],
                 tl.full([BLOCK_M, QK_HEAD_DIM_ROUNDED], 0.0, tl.float32),
                 mask=(offs_m < Q_LEN)[:, None] & (offs_k < QK_HEAD_DIM)[None, :])


# ---------------------------------------------------------------------------------------------
# dK / dV


@triton.jit
def dkdv_inner(
    dk, dv, k, v, Q, DO, LSE, DELTA, BLOCK_IDX, num_blocks,
    b, h, offs_n, Q_LEN, KV_LEN, SM_SCALE,
    stride_qm, stride_qk, stride_dom, stride_dok, stride_lm,
    $score_mod_params $mask_mod_params
    IS_FULL_BLOCKS: tl.constexpr,
    BLOCK_M1: tl.constexpr, BLOCK_N1: tl.constexpr, SPARSE_Q_BLOCK_SIZE: tl.constexpr,
    QK_HEAD_DIM: tl.constexpr, QK_HEAD_DIM_ROUNDED: tl.constexpr,
    V_HEAD_DIM: tl.constexpr, V_HEAD_DIM_ROUNDED: tl.constexpr, SAFE_HEAD_DIM: tl.constexpr,
    IS_DIVISIBLE: tl.constexpr, BLOCKS_ARE_CONTIGUOUS: tl.constexpr, OFFS_INT64: tl.constexpr,
    ACC_DTYPE: tl.constexpr, SCORE_DTYPE: tl.constexpr, SCORES_IN_BASE2: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_IN_FP64: tl.constexpr,
):
    # Transposed tiles: rows are this program's KV positions, columns the query positions.
    SPARSE_Q_MULTIPLE: tl.constexpr = SPARSE_Q_BLOCK_SIZE // BLOCK_M1
    tl.static_assert(SPARSE_Q_MULTIPLE * BLOCK_M1 == SPARSE_Q_BLOCK_SIZE)
    offs_k = tl.arange(0, QK_HEAD_DIM_ROUNDED)
    offs_v = tl.arange(0, V_HEAD_DIM_ROUNDED)
    kv_idx = offs_n[:, None]

    start_m = tl.load(BLOCK_IDX) * SPARSE_Q_BLOCK_SIZE
    for i in range(0, num_blocks * SPARSE_Q_MULTIPLE):
        offs_m = start_m + tl.arange(0, BLOCK_M1)
        rows = ptr_offsets(offs_m, OFFS_INT64)
        q_idx = offs_m[None, :]
        # -- recompute P^T from the scores and the saved LSE
        q = load_tile(Q + rows[:, None] * stride_qm + offs_k[None, :] * stride_qk, offs_m, offs_k,
                      Q_LEN, QK_HEAD_DIM, not IS_DIVISIBLE, not SAFE_HEAD_DIM)
        qkT, sT = score_tile(k, q, b, h, q_idx, kv_idx, SM_SCALE, $score_mod_params
                             BLOCK_N1, BLOCK_M1, ACC_DTYPE, SCORE_DTYPE, SCORES_IN_BASE2,
                             DOT_PRECISION, DOT_IN_FP64)
        valid = visible(b, h, q_idx, kv_idx, Q_LEN, KV_LEN, $mask_mod_params IS_FULL_BLOCKS, IS_DIVISIBLE)
        lse = load_lse_base2(LSE + rows * stride_lm, offs_m, Q_LEN, IS_DIVISIBLE)
        pT = p_from_lse(sT, SM_SCALE, lse[None, :], valid, SCORES_IN_BASE2)
        # -- dV += P^T dO
        do = load_tile(DO + rows[:, None] * stride_dom + offs_v[None, :] * stride_dok, offs_m, offs_v,
                       Q_LEN, V_HEAD_DIM, not IS_DIVISIBLE, not SAFE_HEAD_DIM)
        dv = mma(pT.to(do.dtype), do, dv, DOT_PRECISION, DOT_IN_FP64)
        # -- dS^T = P^T * (dP^T - Delta), through score_mod's derivative; dK += dS^T Q
        dpT = mma(v, tl.trans(do), tl.full([BLOCK_N1, BLOCK_M1], 0.0, ACC_DTYPE), DOT_PRECISION, DOT_IN_FP64)
        delta = load_rows(DELTA + offs_m, offs_m, Q_LEN, 0.0, IS_DIVISIBLE)
        dsT = pT * (dpT - delta[None, :])
        dsT = score_mod_dscore(qkT, b, h, q_idx, kv_idx, dsT, valid, $score_dscore_args).to(ACC_DTYPE)
        dk = mma(dsT.to(q.dtype), q, dk, DOT_PRECISION, DOT_IN_FP64)

        start_m = next_start(start_m, i, BLOCK_IDX, num_blocks, BLOCK_M1, SPARSE_Q_MULTIPLE,
                             SPARSE_Q_BLOCK_SIZE, BLOCKS_ARE_CONTIGUOUS)
    return dk, dv


@triton.jit
def backward_dkdv(
$backward_dkdv_params
):
    tl.static_assert(SPARSE_KV_BLOCK_SIZE % BLOCK_N1 == 0)
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // HKV
    h_kv = pid_bh % HKV
    b64 = b.to(tl.int64)

    offs_n = pid_n * BLOCK_N1 + tl.arange(0, BLOCK_N1)
    offs_k = tl.arange(0, QK_HEAD_DIM_ROUNDED)
    offs_v = tl.arange(0, V_HEAD_DIM_ROUNDED)
    rows = ptr_offsets(offs_n, OFFS_INT64)
    K += b64 * stride_kz + h_kv.to(tl.int64) * stride_kh
    V += b64 * stride_vz + h_kv.to(tl.int64) * stride_vh
    k = load_tile(K + rows[:, None] * stride_kn + offs_k[None, :] * stride_kk, offs_n, offs_k,
                  KV_LEN, QK_HEAD_DIM, not IS_DIVISIBLE, not SAFE_HEAD_DIM)
    v = load_tile(V + rows[:, None] * stride_vn + offs_v[None, :] * stride_vk, offs_n, offs_v,
                  KV_LEN, V_HEAD_DIM, not IS_DIVISIBLE, not SAFE_HEAD_DIM)
    dk = tl.full([BLOCK_N1, QK_HEAD_DIM_ROUNDED], 0.0, ACC_DTYPE)
    dv = tl.full([BLOCK_N1, V_HEAD_DIM_ROUNDED], 0.0, ACC_DTYPE)
    kv_blk = (pid_n * BLOCK_N1) // SPARSE_KV_BLOCK_SIZE

    # -- every query head of the GQA group reads this K/V tile: their gradients add up here
    for g in range(0, GQA_SHARED_HEADS):
        h = h_kv * GQA_SHARED_HEADS + g
        h64 = h.to(tl.int64)
        Qh = Q + b64 * stride_qz + h64 * stride_qh
        DOh = DO + b64 * stride_doz + h64 * stride_doh
        LSEh = LSE + b64 * stride_lz + h64 * stride_lh
        DELTAh = DELTA + (b64 * HQ + h64) * Q_LEN

        num_blocks = tl.load(Q_NUM_BLKS + b64 * stride_nz + h * stride_nh + kv_blk * stride_nn)
        BLOCK_IDX = Q_IDX + b64 * stride_iz + h * stride_ih + kv_blk * stride_in
        dk, dv = dkdv_inner(
            dk, dv, k, v, Qh, DOh, LSEh, DELTAh, BLOCK_IDX, num_blocks,
            b, h, offs_n, Q_LEN, KV_LEN, SM_SCALE,
            stride_qm, stride_qk, stride_dom, stride_dok, stride_lm,
            $score_mod_params $mask_mod_params
            False, BLOCK_M1, BLOCK_N1, SPARSE_Q_BLOCK_SIZE,
            QK_HEAD_DIM, QK_HEAD_DIM_ROUNDED, V_HEAD_DIM, V_HEAD_DIM_ROUNDED, SAFE_HEAD_DIM,
            IS_DIVISIBLE, BLOCKS_ARE_CONTIGUOUS, OFFS_INT64, ACC_DTYPE, SCORE_DTYPE, SCORES_IN_BASE2,
            DOT_PRECISION, DOT_IN_FP64,
        )
        if HAS_FULL_BLOCKS:
            num_blocks = tl.load(FULL_Q_NUM_BLKS + b64 * stride_fnz + h * stride_fnh + kv_blk * stride_fnn)
            BLOCK_IDX = FULL_Q_IDX + b64 * stride_fiz + h * stride_fih + kv_blk * stride_fin
            dk, dv = dkdv_inner(
                dk, dv, k, v, Qh, DOh, LSEh, DELTAh, BLOCK_IDX, num_blocks,
                b, h, offs_n, Q_LEN, KV_LEN, SM_SCALE,
                stride_qm, stride_qk, stride_dom, stride_dok, stride_lm,
                $score_mod_params $mask_mod_params
                True, BLOCK_M1, BLOCK_N1, SPARSE_Q_BLOCK_SIZE,
                QK_HEAD_DIM, QK_HEAD_DIM_ROUNDED, V_HEAD_DIM, V_HEAD_DIM_ROUNDED, SAFE_HEAD_DIM,
                IS_DIVISIBLE, BLOCKS_ARE_CONTIGUOUS, OFFS_INT64, ACC_DTYPE, SCORE_DTYPE, SCORES_IN_BASE2,
                DOT_PRECISION, DOT_IN_FP64,
            )

    dk = dk * SM_SCALE
    DK += b64 * stride_dkz + h_kv.to(tl.int64) * stride_dkh
    DV += b64 * stride_dvz + h_kv.to(tl.int64) * stride_dvh
    store_tile(DK + rows[:, None] * stride_dkn + offs_k[None, :] * stride_dkk, dk.to(DK.dtype.element_ty),
               offs_n, offs_k, KV_LEN, QK_HEAD_DIM, not IS_DIVISIBLE, not SAFE_HEAD_DIM)
    store_tile(DV + rows[:, None] * stride_dvn + offs_v[None, :] * stride_dvk, dv.to(DV.dtype.element_ty),
               offs_n, offs_v, KV_LEN, V_HEAD_DIM, not IS_DIVISIBLE, not SAFE_HEAD_DIM)


# ---------------------------------------------------------------------------------------------
# dQ (and captured-tensor gradients)


@triton.jit
def dq_inner(
    dq, q, do, lse, delta, K, V, BLOCK_IDX, num_blocks,
    b, h, offs_m, Q_LEN, KV_LEN, SM_SCALE,
    stride_kn, stride_kk, stride_vn, stride_vk,
    $score_mod_params $mask_mod_params $grad_params
    IS_FULL_BLOCKS: tl.constexpr,
    BLOCK_M2: tl.constexpr, BLOCK_N2: tl.constexpr, SPARSE_KV_BLOCK_SIZE: tl.constexpr,
    QK_HEAD_DIM: tl.constexpr, QK_HEAD_DIM_ROUNDED: tl.constexpr,
    V_HEAD_DIM: tl.constexpr, V_HEAD_DIM_ROUNDED: tl.constexpr, SAFE_HEAD_DIM: tl.constexpr,
    IS_DIVISIBLE: tl.constexpr, BLOCKS_ARE_CONTIGUOUS: tl.constexpr, OFFS_INT64: tl.constexpr,
    ACC_DTYPE: tl.constexpr, SCORE_DTYPE: tl.constexpr, SCORES_IN_BASE2: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_IN_FP64: tl.constexpr,
):
    SPARSE_KV_MULTIPLE: tl.constexpr = SPARSE_KV_BLOCK_SIZE // BLOCK_N2
    tl.static_assert(SPARSE_KV_MULTIPLE * BLOCK_N2 == SPARSE_KV_BLOCK_SIZE)
    offs_k = tl.arange(0, QK_HEAD_DIM_ROUNDED)
    offs_v = tl.arange(0, V_HEAD_DIM_ROUNDED)
    q_idx = offs_m[:, None]

    start_n = tl.load(BLOCK_IDX) * SPARSE_KV_BLOCK_SIZE
    for i in range(0, num_blocks * SPARSE_KV_MULTIPLE):
        offs_n = start_n + tl.arange(0, BLOCK_N2)
        rows = ptr_offsets(offs_n, OFFS_INT64)
        kv_idx = offs_n[None, :]
        # -- recompute P from the scores and the saved LSE (lse: base 2, loaded once per program)
        k = load_tile(K + rows[:, None] * stride_kn + offs_k[None, :] * stride_kk, offs_n, offs_k,
                      KV_LEN, QK_HEAD_DIM, not IS_DIVISIBLE, not SAFE_HEAD_DIM)
        qk, s = score_tile(q, k, b, h, q_idx, kv_idx, SM_SCALE, $score_mod_params
                           BLOCK_M2, BLOCK_N2, ACC_DTYPE, SCORE_DTYPE, SCORES_IN_BASE2,
                           DOT_PRECISION, DOT_IN_FP64)
        valid = visible(b, h, q_idx, kv_idx, Q_LEN, KV_LEN, $mask_mod_params IS_FULL_BLOCKS, IS_DIVISIBLE)
        p = p_from_lse(s, SM_SCALE, lse[:, None], valid, SCORES_IN_BASE2)
        # -- dS = P * (dP - Delta) through score_mod's derivative (scatters captured grads); dQ += dS K
        v = load_tile(V + rows[:, None] * stride_vn + offs_v[None, :] * stride_vk, offs_n, offs_v,
                      KV_LEN, V_HEAD_DIM, not IS_DIVISIBLE, not SAFE_HEAD_DIM)
        dp = mma(do, tl.trans(v), tl.full([BLOCK_M2, BLOCK_N2], 0.0, ACC_DTYPE), DOT_PRECISION, DOT_IN_FP64)
        ds = p * (dp - delta[:, None])
        ds = score_mod_grad(qk, b, h, q_idx, kv_idx, ds, valid, $score_grad_args).to(ACC_DTYPE)
        dq = mma(ds.to(k.dtype), k, dq, DOT_PRECISION, DOT_IN_FP64)

        start_n = next_start(start_n, i, BLOCK_IDX, num_blocks, BLOCK_N2, SPARSE_KV_MULTIPLE,
                             SPARSE_KV_BLOCK_SIZE, BLOCKS_ARE_CONTIGUOUS)
    return dq


@triton.jit
def backward_dq(
$backward_dq_params
):
    tl.static_assert(SPARSE_Q_BLOCK_SIZE % BLOCK_M2 == 0)
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // HQ
    h = pid_bh % HQ
    h_kv = h // GQA_SHARED_HEADS
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)

    Q += b64 * stride_qz + h64 * stride_qh
    K += b64 * stride_kz + h_kv.to(tl.int64) * stride_kh
    V += b64 * stride_vz + h_kv.to(tl.int64) * stride_vh
    DO += b64 * stride_doz + h64 * stride_doh
    DQ += b64 * stride_dqz + h64 * stride_dqh
    LSE += b64 * stride_lz + h64 * stride_lh
    DELTA += (b64 * HQ + h64) * Q_LEN

    offs_m = pid_m * BLOCK_M2 + tl.arange(0, BLOCK_M2)
    offs_k = tl.arange(0, QK_HEAD_DIM_ROUNDED)
    offs_v = tl.arange(0, V_HEAD_DIM_ROUNDED)
    rows = ptr_offsets(offs_m, OFFS_INT64)
    q = load_tile(Q + rows[:, None] * stride_qm + offs_k[None, :] * stride_qk, offs_m, offs_k,
                  Q_LEN, QK_HEAD_DIM, not IS_DIVISIBLE, not SAFE_HEAD_DIM)
    do = load_tile(DO + rows[:, None] * stride_dom + offs_v[None, :] * stride_dok, offs_m, offs_v,
                   Q_LEN, V_HEAD_DIM, not IS_DIVISIBLE, not SAFE_HEAD_DIM)
    lse = load_lse_base2(LSE + rows * stride_lm, offs_m, Q_LEN, IS_DIVISIBLE)
    delta = load_rows(DELTA + offs_m, offs_m, Q_LEN, 0.0, IS_DIVISIBLE)
    dq = tl.full([BLOCK_M2, QK_HEAD_DIM_ROUNDED], 0.0, ACC_DTYPE)

    q_blk = (pid_m * BLOCK_M2) // SPARSE_Q_BLOCK_SIZE
    num_blocks = tl.load(KV_NUM_BLKS + b64 * stride_nz + h * stride_nh + q_blk * stride_nm)
    BLOCK_IDX = KV_IDX + b64 * stride_iz + h * stride_ih + q_blk * stride_im
    dq = dq_inner(
        dq, q, do, lse, delta, K, V, BLOCK_IDX, num_blocks,
        b, h, offs_m, Q_LEN, KV_LEN, SM_SCALE,
        stride_kn, stride_kk, stride_vn, stride_vk,
        $score_mod_params $mask_mod_params $grad_params
        False, BLOCK_M2, BLOCK_N2, SPARSE_KV_BLOCK_SIZE,
        QK_HEAD_DIM, QK_HEAD_DIM_ROUNDED, V_HEAD_DIM, V_HEAD_DIM_ROUNDED, SAFE_HEAD_DIM,
        IS_DIVISIBLE, BLOCKS_ARE_CONTIGUOUS, OFFS_INT64, ACC_DTYPE, SCORE_DTYPE, SCORES_IN_BASE2,
        DOT_PRECISION, DOT_IN_FP64,
    )
    if HAS_FULL_BLOCKS:
        num_blocks = tl.load(FULL_KV_NUM_BLKS + b64 * stride_fnz + h * stride_fnh + q_blk * stride_fnm)
        BLOCK_IDX = FULL_KV_IDX + b64 * stride_fiz + h * stride_fih + q_blk * stride_fim
        dq = dq_inner(
            dq, q, do, lse, delta, K, V, BLOCK_IDX, num_blocks,
            b, h, offs_m, Q_LEN, KV_LEN, SM_SCALE,
            stride_kn, stride_kk, stride_vn, stride_vk,
            $score_mod_params $mask_mod_params $grad_params
            True, BLOCK_M2, BLOCK_N2, SPARSE_KV_BLOCK_SIZE,
            QK_HEAD_DIM, QK_HEAD_DIM_ROUNDED, V_HEAD_DIM, V_HEAD_DIM_ROUNDED, SAFE_HEAD_DIM,
            IS_DIVISIBLE, BLOCKS_ARE_CONTIGUOUS, OFFS_INT64, ACC_DTYPE, SCORE_DTYPE, SCORES_IN_BASE2,
            DOT_PRECISION, DOT_IN_FP64,
        )

    dq = dq * SM_SCALE
    store_tile(DQ + rows[:, None] * stride_dqm + offs_k[None, :] * stride_dqk, dq.to(DQ.dtype.element_ty),
               offs_m, offs_k, Q_LEN, QK_HEAD_DIM, not IS_DIVISIBLE, not SAFE_HEAD_DIM)
