# Block-sparse attention forward (prefill / training): O = softmax(mask(score_mod(Q K^T * scale))) V.
#
# One program per (query tile, batch x query head). It walks the KV tiles its query block must see:
# first the *partial* ones (score_mod and mask_mod applied), then the *full* ones (mask known to be
# all true: score_mod only), with an online softmax in base 2, and writes O and the row LSE.
#
# sub notation:
#   Q               [B, HQ, Q_LEN, QK_HEAD_DIM]
#   K               [B or 1, HKV, KV_LEN, QK_HEAD_DIM]   (batch 1 broadcasts: the host passes stride 0)
#   V               [B or 1, HKV, KV_LEN, V_HEAD_DIM]
#   Out             [B, HQ, Q_LEN, V_HEAD_DIM]           (any strides; the host matches Q's order)
#   LSE             [B, HQ, Q_LEN] natural log, float32 (float64 for float64 inputs); -inf for rows
#                   that see nothing (SINKS[h] with HAS_SINKS)
#   KV_NUM_BLKS     [Bm, Hm, nQ] int32: how many partial KV blocks query block m visits
#   KV_IDX          [Bm, Hm, nQ, nKV] int32: which ones (first KV_NUM_BLKS entries of each row)
#   FULL_KV_NUM_BLKS, FULL_KV_IDX: the same for full blocks
#                   Bm, Hm are 1 or B, HQ: the host passes stride 0 where the block mask broadcasts
#   MaxScores       [B, HQ, Q_LEN] like LSE: each row's largest modified score (natural units, -inf
#                   for rows that see nothing); written only when OUTPUT_MAX
#   SM_SCALE        runtime float: 1/sqrt(QK_HEAD_DIM) unless the caller gave a scale
#   DESCALE_Q, DESCALE_K, DESCALE_V  float8 inputs (IS_FP8): one float32 each, the factors that
#                   dequantise Q, K and V (FlashAttention-3's per-tensor descale); unused otherwise
#   SINKS           [HQ] (read when HAS_SINKS): one logit per query head that joins every row's
#                   softmax sum as a term exp(SINKS[h]) with no value row; the LSE includes it, a
#                   row that sees nothing writes 0 and LSE = SINKS[h]; MaxScores ignores it
#
# constexprs:
#   BLOCK_M, BLOCK_N       query rows / KV columns of one tile (powers of two >= 16)
#   SPARSE_Q_BLOCK_SIZE    query rows per block-mask block; a multiple of BLOCK_M
#   SPARSE_KV_BLOCK_SIZE   KV columns per block-mask block; a multiple of BLOCK_N (each sparse block
#                          is walked as SPARSE_KV_BLOCK_SIZE // BLOCK_N tiles)
#   QK_HEAD_DIM, V_HEAD_DIM             real head dims (E, Ev)
#   QK_HEAD_DIM_ROUNDED, V_HEAD_DIM_ROUNDED  next powers of two (>= 16): tl.arange/tl.dot shapes
#   SAFE_HEAD_DIM          both head dims are already their rounded sizes: no column masks
#   IS_DIVISIBLE           Q_LEN % BLOCK_M == 0 and KV_LEN is a multiple of every KV tile walked:
#                          no row / column bounds checks at all
#   GQA_SHARED_HEADS       query heads per KV head (HQ // HKV); kv head = h // GQA_SHARED_HEADS
#   HAS_FULL_BLOCKS        FULL_KV_* exist (else only partial blocks are walked)
#   PRESCALE_QK            multiply Q by SM_SCALE once per tile (rounded to Q's dtype: a little less
#                          accurate) instead of every score tile
#   ROWS_GUARANTEED_SAFE   the caller promises no row is fully masked: skip the -inf guard
#   BLOCKS_ARE_CONTIGUOUS  each row's KV blocks are consecutive: step through them without reading
#                          KV_IDX after the first entry
#   OFFS_INT64             some tensor spans more than 2^31 elements: compute tile offsets in int64
#   OUTPUT_MAX             also write MaxScores (torch's AuxRequest(max_scores=True))
#   SCORES_IN_BASE2        there is no score_mod and SM_SCALE > 0 (the host launches the kernel
#                          without it for other scales): SM_SCALE is multiplied by 1 / ln 2 once
#                          and the raw q.k tile goes to the softmax, which folds the scale into
#                          exp2's argument (one FMA per score; a score_mod needs one multiply more)
#   SCORE_AFFINE           score_mod is affine in the score and the positions (codegen/affine.py:
#                          S score + K kv_idx + Q q_idx + C, ALiBi): the scores go to the softmax in
#                          base 2 as q.k (scale S / ln 2) + u(kv_idx), one FMA per score, and each
#                          row's w(q_idx) = Q (q_idx - r) / ln 2 is added to its LSE and max at the
#                          end, with r the tile's first row and u(kv_idx) = (K (kv_idx - r) + (K + Q) r
#                          + C) / ln 2. score_mod_affine(b, h, <buffers>) gives (S, K, Q, C)
#   LONGEST_FIRST          launch query tiles last to first (under a causal mask the last see the
#                          most KV blocks; starting them first shortens the tail of the launch)
#   HAS_SINKS              fold SINKS into each row's max and sum in the epilogue (add_sink)
#   IS_FP8                 Q, K, V are float8_e4m3fn: Q K^T runs in float8 with the descales folded
#                          into SM_SCALE, P is rounded to float8 for P V, and the accumulator is
#                          multiplied by DESCALE_V; Out is bfloat16
#   ACC_DTYPE              float32 (float64 for float64 inputs): scores, softmax state, accumulator
#   SCORE_DTYPE            the dtype score_mod was traced with (its `score` input)
#   DOT_PRECISION          tl.dot input_precision ("ieee", or "tf32" for float32 when torch allows it)
#   DOT_IN_FP64            (Triton's interpreter) feed tl.dot float64 copies of the tiles: its dot is
#                          the host BLAS's matmul, not float32-exact on every CPU, and it gets
#                          bfloat16 arithmetic wrong; with float8 inputs P is not rounded to float8
#                          there (the interpreter's rounding is wrong)
#
# Mods (see flexattn/codegen/emit.py): score_mod(score, b, h, q_idx, kv_idx, <buffers>) and
# mask_mod(b, h, q_idx, kv_idx, <buffers>), with b, h int32 scalars (h is the *query* head),
# q_idx [BLOCK_M, 1] and kv_idx [1, BLOCK_N] int32.
#
# Tile helpers (tiles.py, the tile_helpers hook; shared with the backward and decoding templates):
# ptr_offsets, load_tile / store_tile, mma, online_softmax(_scaled), add_sink, next_start.
$prelude

$score_mod_def

$mask_mod_def


$tile_helpers


@triton.jit
def forward_inner(
    acc, l_i, m_i, q, K, V, BLOCK_IDX, num_blocks,
    b, h, offs_m, KV_LEN, SM_SCALE, KV_FACTOR, KV_BIAS, REF,
    stride_kn, stride_kk, stride_vn, stride_vk,
    $score_mod_params $mask_mod_params
    IS_FULL_BLOCKS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPARSE_KV_BLOCK_SIZE: tl.constexpr,
    QK_HEAD_DIM: tl.constexpr, QK_HEAD_DIM_ROUNDED: tl.constexpr,
    V_HEAD_DIM: tl.constexpr, V_HEAD_DIM_ROUNDED: tl.constexpr, SAFE_HEAD_DIM: tl.constexpr,
    IS_DIVISIBLE: tl.constexpr, PRESCALE_QK: tl.constexpr, ROWS_GUARANTEED_SAFE: tl.constexpr,
    BLOCKS_ARE_CONTIGUOUS: tl.constexpr, OFFS_INT64: tl.constexpr, SCORES_IN_BASE2: tl.constexpr,
    SCORE_AFFINE: tl.constexpr, ACC_DTYPE: tl.constexpr, SCORE_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_IN_FP64: tl.constexpr,
):
    # One shared loop for partial blocks (IS_FULL_BLOCKS=False: mask_mod applied) and full blocks.
    SPARSE_KV_MULTIPLE: tl.constexpr = SPARSE_KV_BLOCK_SIZE // BLOCK_N
    tl.static_assert(SPARSE_KV_MULTIPLE * BLOCK_N == SPARSE_KV_BLOCK_SIZE)
    offs_k = tl.arange(0, QK_HEAD_DIM_ROUNDED)
    offs_v = tl.arange(0, V_HEAD_DIM_ROUNDED)
    q_idx = offs_m[:, None]

    start_n = tl.load(BLOCK_IDX) * SPARSE_KV_BLOCK_SIZE
    for i in range(0, num_blocks * SPARSE_KV_MULTIPLE):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        rows = ptr_offsets(offs_n, OFFS_INT64)
        # -- scores: qk = q @ k^T in ACC_DTYPE
        k = load_tile(K + rows[:, None] * stride_kn + offs_k[None, :] * stride_kk, offs_n, offs_k,
                      KV_LEN, QK_HEAD_DIM, not IS_DIVISIBLE, not SAFE_HEAD_DIM)
        qk = mma(q, tl.trans(k), tl.full([BLOCK_M, BLOCK_N], 0.0, ACC_DTYPE), DOT_PRECISION, DOT_IN_FP64)
        kv_idx = offs_n[None, :]
        if SCORES_IN_BASE2:
            s = qk  # no score_mod: the softmax below multiplies by SM_SCALE (> 0, with 1 / ln 2)
        elif SCORE_AFFINE:  # (SM_SCALE is the score's factor in base 2 here)
            s = qk * SM_SCALE + (KV_FACTOR * (offs_n - REF).to(ACC_DTYPE) + KV_BIAS)[None, :]
        else:
            if not PRESCALE_QK:
                qk = qk * SM_SCALE
            s = score_mod(qk.to(SCORE_DTYPE), b, h, q_idx, kv_idx, $score_mod_params).to(ACC_DTYPE)
        if not IS_FULL_BLOCKS:
            s = tl.where(mask_mod(b, h, q_idx, kv_idx, $mask_mod_params), s, float("-inf"))
        if not IS_DIVISIBLE:
            s = tl.where(kv_idx < KV_LEN, s, float("-inf"))

        # -- online softmax in base 2: m_i is the running row max, l_i the running row sum
        if SCORES_IN_BASE2:
            p, alpha, l_i, m_i = online_softmax_scaled(s, SM_SCALE, m_i, l_i, ROWS_GUARANTEED_SAFE)
        elif SCORE_AFFINE:  # (already in base 2)
            p, alpha, l_i, m_i = online_softmax_scaled(s, 1.0, m_i, l_i, ROWS_GUARANTEED_SAFE)
        else:
            p, alpha, l_i, m_i = online_softmax(s, m_i, l_i, ROWS_GUARANTEED_SAFE)
        v = load_tile(V + rows[:, None] * stride_vn + offs_v[None, :] * stride_vk, offs_n, offs_v,
                      KV_LEN, V_HEAD_DIM, not IS_DIVISIBLE, not SAFE_HEAD_DIM)
        if DOT_IN_FP64 and v.dtype == tl.float8e4nv:
            pv = p  # Triton's interpreter rounds float32 to float8 wrongly: P stays float32 on the CPU
        else:
            pv = p.to(v.dtype)
        acc = mma(pv, v, acc * alpha[:, None], DOT_PRECISION, DOT_IN_FP64)

        # -- next tile: the next BLOCK_N columns of this sparse block, or the start of the next block
        start_n = next_start(start_n, i, BLOCK_IDX, num_blocks, BLOCK_N, SPARSE_KV_MULTIPLE,
                             SPARSE_KV_BLOCK_SIZE, BLOCKS_ARE_CONTIGUOUS)
    return acc, l_i, m_i


@triton.jit
def flex_attention_forward(
$flex_attention_forward_params
):
    tl.static_assert(SPARSE_Q_BLOCK_SIZE % BLOCK_M == 0)
    if IS_FP8:  # scores of the dequantised inputs: (q dq)(k dk)^T scale = q k^T (scale dq dk)
        SM_SCALE = SM_SCALE * tl.load(DESCALE_Q) * tl.load(DESCALE_K)
        if SCORES_IN_BASE2:  # the fold needs a positive factor: descales that are not give NaN
            SM_SCALE = tl.where(SM_SCALE > 0, SM_SCALE, float("nan"))
    LN2: tl.constexpr = 0.6931471805599453
    if SCORES_IN_BASE2:
        SM_SCALE = SM_SCALE * (1.0 / LN2)
    if LONGEST_FIRST:  # the last query tiles see the most KV blocks (causal): start them first
        pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    else:
        pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // HQ
    h = pid_bh % HQ
    h_kv = h // GQA_SHARED_HEADS

    # -- this (batch, head)'s slices; int64 so that large tensors do not overflow
    b64 = b.to(tl.int64)
    Q += b64 * stride_qz + h.to(tl.int64) * stride_qh
    K += b64 * stride_kz + h_kv.to(tl.int64) * stride_kh
    V += b64 * stride_vz + h_kv.to(tl.int64) * stride_vh
    Out += b64 * stride_oz + h.to(tl.int64) * stride_oh
    LSE += b64 * stride_lz + h.to(tl.int64) * stride_lh
    MaxScores += b64 * stride_lz + h.to(tl.int64) * stride_lh

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, QK_HEAD_DIM_ROUNDED)
    offs_v = tl.arange(0, V_HEAD_DIM_ROUNDED)
    rows = ptr_offsets(offs_m, OFFS_INT64)
    q = load_tile(Q + rows[:, None] * stride_qm + offs_k[None, :] * stride_qk, offs_m, offs_k,
                  Q_LEN, QK_HEAD_DIM, not IS_DIVISIBLE, not SAFE_HEAD_DIM)
    if PRESCALE_QK:
        q = (q.to(ACC_DTYPE) * SM_SCALE).to(q.dtype)

    REF = pid_m * BLOCK_M  # (SCORE_AFFINE's reference position)
    KV_FACTOR = 0.0
    KV_BIAS = 0.0
    if SCORE_AFFINE:  # from here SM_SCALE is the factor of q.k in base 2 (Q was scaled above)
        aff_s, aff_k, aff_q, aff_c = score_mod_affine(b, h, $score_mod_params)
        KV_FACTOR = aff_k * (1.0 / LN2)
        KV_BIAS = ((aff_k + aff_q) * REF.to(tl.float32) + aff_c) * (1.0 / LN2)
        if PRESCALE_QK:
            SM_SCALE = aff_s * (1.0 / LN2)
        else:
            SM_SCALE = SM_SCALE * aff_s * (1.0 / LN2)

    acc = tl.full([BLOCK_M, V_HEAD_DIM_ROUNDED], 0.0, ACC_DTYPE)
    l_i = tl.full([BLOCK_M], 0.0, ACC_DTYPE)
    sink = 0.0
    if HAS_SINKS:  # (loaded before the KV loop: at the epilogue its latency would be exposed)
        sink = tl.load(SINKS + h).to(ACC_DTYPE) * (1.0 / LN2)
    m_i = tl.full([BLOCK_M], float("-inf"), ACC_DTYPE)

    # -- partial blocks, then full blocks, of this query block's row in the block mask
    q_blk = (pid_m * BLOCK_M) // SPARSE_Q_BLOCK_SIZE
    num_blocks = tl.load(KV_NUM_BLKS + b64 * stride_nz + h * stride_nh + q_blk * stride_nm)
    BLOCK_IDX = KV_IDX + b64 * stride_iz + h * stride_ih + q_blk * stride_im
    acc, l_i, m_i = forward_inner(
        acc, l_i, m_i, q, K, V, BLOCK_IDX, num_blocks,
        b, h, offs_m, KV_LEN, SM_SCALE, KV_FACTOR, KV_BIAS, REF,
        stride_kn, stride_kk, stride_vn, stride_vk,
        $score_mod_params $mask_mod_params
        False, BLOCK_M, BLOCK_N, SPARSE_KV_BLOCK_SIZE,
        QK_HEAD_DIM, QK_HEAD_DIM_ROUNDED, V_HEAD_DIM, V_HEAD_DIM_ROUNDED, SAFE_HEAD_DIM,
        IS_DIVISIBLE, PRESCALE_QK, ROWS_GUARANTEED_SAFE, BLOCKS_ARE_CONTIGUOUS, OFFS_INT64,
        SCORES_IN_BASE2, SCORE_AFFINE, ACC_DTYPE, SCORE_DTYPE, DOT_PRECISION, DOT_IN_FP64,
    )
    if HAS_FULL_BLOCKS:
        num_blocks = tl.load(FULL_KV_NUM_BLKS + b64 * stride_fnz + h * stride_fnh + q_blk * stride_fnm)
        BLOCK_IDX = FULL_KV_IDX + b64 * stride_fiz + h * stride_fih + q_blk * stride_fim
        acc, l_i, m_i = forward_inner(
            acc, l_i, m_i, q, K, V, BLOCK_IDX, num_blocks,
            b, h, offs_m, KV_LEN, SM_SCALE, KV_FACTOR, KV_BIAS, REF,
            stride_kn, stride_kk, stride_vn, stride_vk,
            $score_mod_params $mask_mod_params
            True, BLOCK_M, BLOCK_N, SPARSE_KV_BLOCK_SIZE,
            QK_HEAD_DIM, QK_HEAD_DIM_ROUNDED, V_HEAD_DIM, V_HEAD_DIM_ROUNDED, SAFE_HEAD_DIM,
            IS_DIVISIBLE, PRESCALE_QK, ROWS_GUARANTEED_SAFE, BLOCKS_ARE_CONTIGUOUS, OFFS_INT64,
            SCORES_IN_BASE2, SCORE_AFFINE, ACC_DTYPE, SCORE_DTYPE, DOT_PRECISION, DOT_IN_FP64,
        )

    if IS_FP8:
        acc = acc * tl.load(DESCALE_V)
    # -- epilogue. m_i and l_i are in base 2, without the SCORE_AFFINE rows' own term w(q_idx)
    # (the softmax did not need it); max_scores is m_i's, the LSE's reference m_lse includes the sink.
    if SCORE_AFFINE:
        row_w = aff_q * (offs_m - REF).to(ACC_DTYPE) * (1.0 / LN2)
    m_lse = m_i
    if HAS_SINKS:  # the sink joins each row's sum, in m_i's units
        if SCORE_AFFINE:
            sink = sink - row_w
        m_lse, l_i, alpha = add_sink(m_i, l_i, sink)
        acc = acc * alpha[:, None]
    # A fully masked row (without a sink) has l_i = 0 and acc = 0: divide by 1 so that it writes
    # 0, and give it LSE -inf directly (log2(0) would be -inf too, but is not worth computing).
    if ROWS_GUARANTEED_SAFE:
        acc = acc / l_i[:, None]
        lse2 = m_lse + tl.log2(l_i)
    else:
        empty = l_i == 0.0
        acc = acc / tl.where(empty, 1.0, l_i)[:, None]
        lse2 = tl.where(empty, float("-inf"), m_lse + tl.log2(tl.where(empty, 1.0, l_i)))
    if SCORE_AFFINE:
        lse2 += row_w
        m_i += row_w
    store_tile(Out + rows[:, None] * stride_om + offs_v[None, :] * stride_ok, acc.to(Out.dtype.element_ty),
               offs_m, offs_v, Q_LEN, V_HEAD_DIM, not IS_DIVISIBLE, not SAFE_HEAD_DIM)
    lse = (lse2 * LN2).to(LSE.dtype.element_ty)
    if IS_DIVISIBLE:
        tl.store(LSE + offs_m, lse)
    else:
        tl.store(LSE + offs_m, lse, mask=offs_m < Q_LEN)
    if OUTPUT_MAX:
        # m_i is the running max of the modified scores in base-2 units (-inf for empty rows).
        mx = (m_i * LN2).to(MaxScores.dtype.element_ty)
        if IS_DIVISIBLE:
            tl.store(MaxScores + offs_m, mx)
        else:
            tl.store(MaxScores + offs_m, mx, mask=offs_m < Q_LEN)
