# Block-sparse attention forward for Hopper (sm_90), bfloat16 / float16 / float8, in Gluon: the same
# computation, arguments and outputs as forward.py (read its header for the tables, LSE and mods),
# scheduled by hand the way FlashAttention-3 schedules it.
#
# One program per (query tile of BLOCK_M = 64 x NUM_CONSUMERS rows, batch x query head), a loader
# and a consumer per 64 rows:
#   loader      1 warp: TMA copies of the Q tile once (in boxes of up to 128 rows: a TMA box's
#               sides are powers of two), then of each K and V tile into a ring of NUM_BUFFERS
#               shared-memory slots (k_ready / v_ready: "the copy landed"; k_empty / v_empty:
#               "every consumer is done with the slot")
#   consumer 0  4 warps (a warp group): query rows 0..63 of the tile
#   consumer 1  4 warps: rows 64..127
#   consumer 2  4 warps: rows 128..191, at head dim 64 only (kernels/hopper.py's BLOCK_M)
# Each consumer runs the online softmax over the same KV tiles. Per tile j it issues q.k_j^T and
# P_{j-1}.v_{j-1} on the tensor cores (asynchronous wgmma), waits for the scores, runs the softmax
# of tile j, waits for P.V, then rescales the accumulator (ptxas moves that second wait up to the
# top of its basic block, before the softmax; putting it back measured level or slower:
# python -m benchmarks attention). The consumers take turns, in a ring, to issue their matrix
# multiplies (the `turns` barriers): while one runs its softmax, the others' multiplies keep the
# tensor cores busy ("ping-pong"). At head dim 64 a tile's multiplies take half as long as at 128
# for the same softmax, and two consumers left the tensor cores idle: 449 TF/s without a mask,
# level with the Triton template, against 527 with three (H100, B=4 H=32 S=8k).
#
# Differences from forward.py: Q, K, V arrive as TMA descriptors over the [B, H, L, E] tensors (the
# host checks alignment); the output's rows are contiguous, and for 16-bit inputs (O_TMA) the output
# leaves through a TMA descriptor too: each consumer writes its rows into its rows of the Q tile,
# which nothing reads any more, and the TMA unit stores them (the epilogue and the gap to the next
# program on the SM take about 1 us less each than with stores from the registers: 16 documents
# 9-14% faster, causal at S=2k 11%; python -m benchmarks attention); head dim 64, 128 or 256 for both
# (E == Ev; KV tiles of BLOCK_N = 128 or 64 columns, see kernels/hopper.py); no PRESCALE_QK; the mask work of
# a tile (mask_mod and the KV_LEN bound) is done only for partial blocks and for the tile that
# holds KV_LEN; SCORE_AFFINE (forward.py) takes positions relative to each consumer's first row.
#
# IS_FP8: Q, K, V are float8_e4m3fn and both products run on float8 wgmma, which reads its B operand
# K-major only: V's descriptor is over the [B, H, Ev, L] view of a V stored KV-innermost (the host's
# layout.k_major), its tiles [Ev, BLOCK_N]. P is rounded to float8; SM_SCALE takes
# DESCALE_Q * DESCALE_K (NaN when the product is not positive and the softmax folds it into exp2),
# the epilogue multiplies by DESCALE_V; Out is bfloat16.
$prelude

$score_mod_def

$mask_mod_def


$gluon_tiles

@gluon.jit
def loader(Q, K, V, q_smem, k_bufs, v_bufs, q_bar, k_ready, k_empty, v_ready, v_empty,
           b, h, b_kv, h_kv, off_m, n_partial, n_tiles, P_IDX, F_IDX,
           TILES_PER_BLOCK: gl.constexpr, SPARSE_KV_BLOCK_SIZE: gl.constexpr, BLOCK_N: gl.constexpr,
           BLOCKS_ARE_CONTIGUOUS: gl.constexpr, V_K_MAJOR: gl.constexpr):
    if n_tiles > 0:  # (no copy left in flight when the program ends)
        # (a TMA box's sides are powers of two: a 192-row tile is three 64-row boxes)
        Q_BOXES: gl.constexpr = q_smem.type.shape[0]
        mbarrier.expect(q_bar, Q.block_type.nbytes * Q_BOXES)
        for i in gl.static_range(Q_BOXES):
            _tma_load(Q, [b, h, off_m + i * Q.block_type.shape[2], 0], q_bar, q_smem.index(i))
    load_kv_ring(K, V, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty, b_kv, h_kv, n_partial, n_tiles,
                 P_IDX, F_IDX, TILES_PER_BLOCK, SPARSE_KV_BLOCK_SIZE, BLOCK_N, BLOCKS_ARE_CONTIGUOUS, V_K_MAJOR)


@gluon.jit
def scores(s, j, n_partial, P_IDX, F_IDX, b, h, q_idx, KV_LEN, SM_SCALE, KV_FACTOR, KV_BIAS, REF,
           $score_mod_params $mask_mod_params
           s_layout: gl.constexpr, TILES_PER_BLOCK: gl.constexpr, SPARSE_KV_BLOCK_SIZE: gl.constexpr,
           BLOCK_N: gl.constexpr, BLOCKS_ARE_CONTIGUOUS: gl.constexpr, IS_DIVISIBLE: gl.constexpr,
           SCORES_IN_BASE2: gl.constexpr, SCORE_AFFINE: gl.constexpr, SCORE_DTYPE: gl.constexpr):
    """The q.k^T tile -> the softmax's input: scores in base 2 (times SM_SCALE / ln 2 when
    SCORES_IN_BASE2, where the softmax folds that factor in), mods and masks applied. With
    SCORE_AFFINE, SM_SCALE is q.k's factor in base 2 and the KV columns' term u(kv_idx) = KV_FACTOR
    (kv_idx - REF) + KV_BIAS is added (the rows' term waits for the epilogue: see forward.py)."""
    start = tile_start(j, n_partial, P_IDX, F_IDX, TILES_PER_BLOCK, SPARSE_KV_BLOCK_SIZE, BLOCK_N,
                       BLOCKS_ARE_CONTIGUOUS)
    kv_idx = gl.expand_dims(start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout)), 0)
    if SCORE_AFFINE:
        s = s * SM_SCALE + (KV_FACTOR * (kv_idx - REF).to(gl.float32) + KV_BIAS)
    elif not SCORES_IN_BASE2:
        s = score_mod((s * SM_SCALE).to(SCORE_DTYPE), b, h, q_idx, kv_idx, $score_mod_params).to(gl.float32) * LOG2E
    partial = j < n_partial
    if IS_DIVISIBLE:
        if partial:
            s = gl.where(mask_mod(b, h, q_idx, kv_idx, $mask_mod_params), s, -float("inf"))
    else:
        if partial | (start + BLOCK_N > KV_LEN):
            keep = mask_mod(b, h, q_idx, kv_idx, $mask_mod_params) & (kv_idx < KV_LEN)
            s = gl.where(keep, s, -float("inf"))
    return s


@gluon.jit
def row_max(s):
    """max over a tile's rows in two chains of half the length: a thread holds pairs of adjacent
    columns, so splitting them off moves no data."""
    a, b = gl.split(gl.reshape(s, [s.shape[0], s.shape[1] // 2, 2]))
    return gl.convert_layout(gl.max(gl.maximum(a, b), 1), gl.SliceLayout(1, s.type.layout))


@gluon.jit
def row_sum(s):
    """sum over a tile's rows, split like row_max."""
    a, b = gl.split(gl.reshape(s, [s.shape[0], s.shape[1] // 2, 2]))
    return gl.convert_layout(gl.sum(a + b, 1), gl.SliceLayout(1, s.type.layout))


@gluon.jit
def softmax_step(s, m_i, SOFTMAX_SCALE, SCORES_IN_BASE2: gl.constexpr):
    """(p, new m_i, alpha) of one tile: m_i is the running row max in base 2; rows that have seen
    nothing keep m_i = -inf and get p = 0."""
    if SCORES_IN_BASE2:
        m_new = gl.maximum(m_i, row_max(s) * SOFTMAX_SCALE)
        m_use = gl.where(m_new == -float("inf"), 0.0, m_new)
        p = gl.exp2(s * SOFTMAX_SCALE - gl.expand_dims(m_use, 1))
    else:
        m_new = gl.maximum(m_i, row_max(s))
        m_use = gl.where(m_new == -float("inf"), 0.0, m_new)
        p = gl.exp2(s - gl.expand_dims(m_use, 1))
    alpha = gl.exp2(m_i - m_use)
    return p, m_new, alpha


@gluon.jit
def add_sink(m_i, l_i, sink):
    """(new m_i, new l_i, alpha) of the epilogue's attention sink: a term 2^sink (in m_i's base-2
    units) joins each row's sum with no value row (tiles.py's add_sink); a row that saw nothing
    gets m = sink, l = 1, alpha = 0."""
    m_new = gl.maximum(m_i, sink)
    m_use = gl.where(m_new == -float("inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_use)
    return m_new, l_i * alpha + gl.exp2(sink - m_use), alpha


@gluon.jit
def v_tile(v_bufs, slot, V_K_MAJOR: gl.constexpr):
    """The [BLOCK_N, Ev] B operand of P V from a slot of V tiles ([Ev, BLOCK_N] tiles when V_K_MAJOR)."""
    if V_K_MAJOR:
        return v_bufs.index(slot).reshape([v_bufs.type.shape[3], v_bufs.type.shape[4]]).permute((1, 0))
    else:
        return v_bufs.index(slot).reshape([v_bufs.type.shape[3], v_bufs.type.shape[4]])


@gluon.jit
def wait_pv(acc, p_op, IS_FP8: gl.constexpr):
    """Waits for the P V in flight. Its A operand p_op lives in registers that must stay untouched
    until then: a dependency of the wait keeps them so. Triton's wait takes no 8-bit dependencies
    (triton 3.6-3.9); the next float8 P is made after the wait in program order, and ptxas, which
    places PTX's registers, knows wgmma's operands (checked on the sm_90a build: the conversions
    follow the wait, no multiply serialised, the GPU tests compare with float64)."""
    if IS_FP8:
        acc = warpgroup_mma_wait(0, deps=(acc, ))
    else:
        acc, p_op = warpgroup_mma_wait(0, deps=(acc, p_op))
    return acc, p_op


@gluon.jit
def consumer(q_smem, k_bufs, v_bufs, q_bar, k_ready, k_empty, v_ready, v_empty, turns,
             Out, LSE, MaxScores, DESCALE_V, SINKS, b, h, off_m, n_partial, n_tiles, P_IDX, F_IDX,
             stride_om, Q_LEN, KV_LEN, SM_SCALE,
             $score_mod_params $mask_mod_params
             WG: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, V_HEAD_DIM: gl.constexpr,
             TILES_PER_BLOCK: gl.constexpr, SPARSE_KV_BLOCK_SIZE: gl.constexpr, BLOCKS_ARE_CONTIGUOUS: gl.constexpr,
             IS_DIVISIBLE: gl.constexpr, SCORES_IN_BASE2: gl.constexpr, SCORE_AFFINE: gl.constexpr,
             OUTPUT_MAX: gl.constexpr, HAS_SINKS: gl.constexpr, SCORE_DTYPE: gl.constexpr, IS_FP8: gl.constexpr,
             O_TMA: gl.constexpr):
    NUM_BUFFERS: gl.constexpr = k_bufs.type.shape[0]
    ROWS: gl.constexpr = 64  # (a warp group's wgmma rows)
    # (the consumers take turns in a ring, consumer 0 first)
    NUM_CONSUMERS: gl.constexpr = turns.type.shape[0]
    my_turn = turns.index(WG)
    next_turn = turns.index((WG + 1) % NUM_CONSUMERS)
    FIRST: gl.constexpr = 1 if WG == 0 else 0
    dtype: gl.constexpr = k_bufs.dtype
    QK_HEAD_DIM: gl.constexpr = k_bufs.type.shape[4]
    # (wgmma's K step is 32 bytes: 16 16-bit or 32 float8 elements; a thread holds 4 bytes of a row of P)
    K_STEP: gl.constexpr = 256 // dtype.primitive_bitwidth
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, K_STEP])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, V_HEAD_DIM, K_STEP])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout,
                                                 k_width=32 // dtype.primitive_bitwidth)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    SOFTMAX_SCALE = SM_SCALE * LOG2E

    my_m = off_m + WG * ROWS
    QK_FACTOR = SM_SCALE  # q.k's factor in `scores`
    KV_FACTOR = 0.0
    KV_BIAS = 0.0
    if SCORE_AFFINE:  # (forward.py's SCORE_AFFINE; positions relative to this consumer's first row)
        aff_s, aff_k, aff_q, aff_c = score_mod_affine(b, h, $score_mod_params)
        QK_FACTOR = SM_SCALE * aff_s * LOG2E
        KV_FACTOR = aff_k * LOG2E
        KV_BIAS = ((aff_k + aff_q) * my_m.to(gl.float32) + aff_c) * LOG2E
    sink = 0.0
    if HAS_SINKS:  # (loaded before the KV loop: at the epilogue its latency would be exposed)
        sink = gl.load(SINKS + h).to(gl.float32) * LOG2E
    q_idx = gl.expand_dims(my_m + gl.arange(0, ROWS, layout=row_s), 1)
    Q_ROWS: gl.constexpr = q_smem.type.shape[3]  # (the Q tile in boxes of Q_ROWS rows: see the loader)
    q_box = q_smem.index(WG * ROWS // Q_ROWS)
    q = q_box.reshape([Q_ROWS, QK_HEAD_DIM]).slice(WG * ROWS % Q_ROWS, ROWS, dim=0)
    m_i = gl.full([ROWS], -float("inf"), gl.float32, layout=row_s)
    l_i = gl.full([ROWS], 0.0, gl.float32, layout=row_s)
    acc = gl.zeros([ROWS, V_HEAD_DIM], gl.float32, layout=o_layout)
    s = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout)

    if n_tiles > 0:
        mbarrier.wait(q_bar, 0)
        # -- tile 0: scores and softmax (there is no P.V before it to overlap)
        mbarrier.wait(k_ready.index(0), 0)
        mbarrier.wait(my_turn, FIRST)
        s = warpgroup_mma(q, k_bufs.index(0).reshape([BLOCK_N, QK_HEAD_DIM]).permute((1, 0)), s,
                          use_acc=False, is_async=True)
        mbarrier.arrive(next_turn, count=1)
        s = warpgroup_mma_wait(0, deps=(s, ))
        mbarrier.arrive(k_empty.index(0), count=1)
        s = scores(s, 0, n_partial, P_IDX, F_IDX, b, h, q_idx, KV_LEN, QK_FACTOR, KV_FACTOR, KV_BIAS, my_m,
                   $score_mod_params $mask_mod_params
                   s_layout, TILES_PER_BLOCK, SPARSE_KV_BLOCK_SIZE, BLOCK_N, BLOCKS_ARE_CONTIGUOUS, IS_DIVISIBLE,
                   SCORES_IN_BASE2, SCORE_AFFINE, SCORE_DTYPE)
        p, m_i, alpha = softmax_step(s, m_i, SOFTMAX_SCALE, SCORES_IN_BASE2)
        l_i = row_sum(p)
        p_op = gl.convert_layout(p.to(dtype), p_layout)

        for j in range(1, n_tiles):
            slot = j % NUM_BUFFERS
            prev = (j - 1) % NUM_BUFFERS
            mbarrier.wait(k_ready.index(slot), (j // NUM_BUFFERS) & 1)
            mbarrier.wait(v_ready.index(prev), ((j - 1) // NUM_BUFFERS) & 1)
            # -- this consumer's turn: q.k_j^T, then P_{j-1}.v_{j-1}, both asynchronous
            mbarrier.wait(my_turn, (j & 1) ^ FIRST)
            s = warpgroup_mma(q, k_bufs.index(slot).reshape([BLOCK_N, QK_HEAD_DIM]).permute((1, 0)), s,
                              use_acc=False, is_async=True)
            acc = warpgroup_mma(p_op, v_tile(v_bufs, prev, IS_FP8), acc, is_async=True)
            mbarrier.arrive(next_turn, count=1)
            # -- the scores are ready once at most one multiply (P.V) is in flight
            s = warpgroup_mma_wait(1, deps=(s, ))
            mbarrier.arrive(k_empty.index(slot), count=1)
            s = scores(s, j, n_partial, P_IDX, F_IDX, b, h, q_idx, KV_LEN, QK_FACTOR, KV_FACTOR, KV_BIAS, my_m,
                       $score_mod_params $mask_mod_params
                       s_layout, TILES_PER_BLOCK, SPARSE_KV_BLOCK_SIZE, BLOCK_N, BLOCKS_ARE_CONTIGUOUS,
                       IS_DIVISIBLE, SCORES_IN_BASE2, SCORE_AFFINE, SCORE_DTYPE)
            p, m_i, alpha = softmax_step(s, m_i, SOFTMAX_SCALE, SCORES_IN_BASE2)
            l_i = l_i * alpha + row_sum(p)
            acc, p_op = wait_pv(acc, p_op, IS_FP8)
            mbarrier.arrive(v_empty.index(prev), count=1)
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
            p_op = gl.convert_layout(p.to(dtype), p_layout)

        # -- P.V of the last tile
        last = (n_tiles - 1) % NUM_BUFFERS
        mbarrier.wait(v_ready.index(last), ((n_tiles - 1) // NUM_BUFFERS) & 1)
        acc = warpgroup_mma(p_op, v_tile(v_bufs, last, IS_FP8), acc, is_async=True)
        acc, p_op = wait_pv(acc, p_op, IS_FP8)
        mbarrier.arrive(v_empty.index(last), count=1)

    # -- epilogue (forward.py's): m_i and l_i in base 2 without the SCORE_AFFINE rows' own term
    # w(q_idx); max_scores is m_i's, the LSE's reference m_lse includes the sink
    rows = my_m + gl.arange(0, ROWS, layout=row_s)
    if SCORE_AFFINE:
        row_w = aff_q * (rows - my_m).to(gl.float32) * LOG2E
    m_lse = m_i
    if HAS_SINKS:  # the sink joins each row's sum, in m_i's units
        if SCORE_AFFINE:
            sink = sink - row_w
        m_lse, l_i, alpha = add_sink(m_i, l_i, sink)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
    # a row that saw nothing (and no sink) has l_i = 0, acc = 0: it writes 0 and LSE -inf
    empty = l_i == 0.0
    l_use = gl.where(empty, 1.0, l_i)
    if IS_FP8:
        l_use_o = gl.convert_layout(l_use / gl.load(DESCALE_V), row_o)
    else:
        l_use_o = gl.convert_layout(l_use, row_o)
    out = acc / gl.expand_dims(l_use_o, 1)
    if O_TMA:
        # this consumer's rows of the Q tile (no q.k^T reads them after the last scores' wait)
        # stage the output for the TMA unit, which clips rows past Q_LEN; the store is waited for
        # (its reads of shared memory) at the end
        q.store(out.to(dtype))
        fence_async_shared()
        _sync_warps()
        _tma_store(Out, [b, h, my_m, 0], q_box.slice(WG * ROWS % Q_ROWS, ROWS, dim=2))
    else:
        rows_o = gl.expand_dims(my_m + gl.arange(0, ROWS, layout=row_o), 1)
        cols_o = gl.expand_dims(gl.arange(0, V_HEAD_DIM, layout=gl.SliceLayout(0, o_layout)), 0)
        gl.store(Out + rows_o.to(gl.int64) * stride_om + cols_o, out.to(Out.dtype.element_ty),
                 mask=rows_o < Q_LEN)
    lse2 = gl.where(empty, -float("inf"), m_lse + gl.log2(l_use))
    if SCORE_AFFINE:
        lse2 += row_w
        m_i += row_w
    gl.store(LSE + rows, lse2 * LN2, mask=rows < Q_LEN)
    if OUTPUT_MAX:
        gl.store(MaxScores + rows, m_i * LN2, mask=rows < Q_LEN)
    if O_TMA:
        tma.store_wait(0)


@gluon.jit
def flex_attention_forward(
$flex_attention_forward_params
):
    gl.static_assert(SPARSE_Q_BLOCK_SIZE % BLOCK_M == 0)
    gl.static_assert(SPARSE_KV_BLOCK_SIZE % BLOCK_N == 0)
    TILES_PER_BLOCK: gl.constexpr = SPARSE_KV_BLOCK_SIZE // BLOCK_N
    V_HEAD_DIM: gl.constexpr = Q.block_type.shape[3]  # (== Ev)
    if IS_FP8:  # scores of the dequantised inputs: (q dq)(k dk)^T scale = q k^T (scale dq dk)
        SM_SCALE = SM_SCALE * gl.load(DESCALE_Q) * gl.load(DESCALE_K)
        if SCORES_IN_BASE2:  # the fold needs a positive factor: descales that are not give NaN
            SM_SCALE = gl.where(SM_SCALE > 0, SM_SCALE, float("nan"))
    pid_m, pid_bh = program_tile(HEAD_GROUP)
    if LONGEST_FIRST:  # the last query tiles see the most KV blocks (causal): start them first
        pid_m = gl.num_programs(0) - 1 - pid_m
    b = pid_bh // HQ
    h = pid_bh % HQ
    h_kv = h // GQA_SHARED_HEADS
    b_kv = 0 if KV_BATCH_BROADCAST else b
    off_m = pid_m * BLOCK_M
    b64 = b.to(gl.int64)
    if not O_TMA:
        Out += b64 * stride_oz + h.to(gl.int64) * stride_oh
    LSE += b64 * stride_lz + h.to(gl.int64) * stride_lh
    MaxScores += b64 * stride_lz + h.to(gl.int64) * stride_lh

    n_partial, n_tiles, P_IDX, F_IDX = kv_lists(
        KV_NUM_BLKS, KV_IDX, FULL_KV_NUM_BLKS, FULL_KV_IDX, b64, h, off_m // SPARSE_Q_BLOCK_SIZE,
        stride_nz, stride_nh, stride_nm, stride_iz, stride_ih, stride_im,
        stride_fnz, stride_fnh, stride_fnm, stride_fiz, stride_fih, stride_fim, TILES_PER_BLOCK, HAS_FULL_BLOCKS)

    q_smem = gl.allocate_shared_memory(Q.dtype, [BLOCK_M // Q.block_type.shape[2]] + Q.block_type.shape, Q.layout)
    k_bufs = gl.allocate_shared_memory(K.dtype, [NUM_BUFFERS] + K.block_type.shape, K.layout)
    v_bufs = gl.allocate_shared_memory(V.dtype, [NUM_BUFFERS] + V.block_type.shape, V.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    NUM_CONSUMERS: gl.constexpr = BLOCK_M // 64
    turns = gl.allocate_shared_memory(gl.int64, [NUM_CONSUMERS, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(NUM_CONSUMERS):
        mbarrier.init(turns.index(i), count=1)
    for i in gl.static_range(NUM_BUFFERS):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=NUM_CONSUMERS)  # one arrival per consumer
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(v_empty.index(i), count=NUM_CONSUMERS)

    # (Gluon's partitions are listed one by one: a consumer's entry differs only by its index, WG)
    if NUM_CONSUMERS == 3:  # (head dim 64: 192-row tiles, FlashAttention-3's shape there)
        gl.warp_specialize([
            (consumer, (q_smem, k_bufs, v_bufs, q_bar, k_ready, k_empty, v_ready, v_empty, turns,
                        Out, LSE, MaxScores, DESCALE_V, SINKS, b, h, off_m, n_partial, n_tiles,
                        P_IDX, F_IDX,
                        stride_om, Q_LEN, KV_LEN, SM_SCALE,
                        $score_mod_params $mask_mod_params
                        0, BLOCK_M, BLOCK_N, V_HEAD_DIM, TILES_PER_BLOCK, SPARSE_KV_BLOCK_SIZE, BLOCKS_ARE_CONTIGUOUS,
                        IS_DIVISIBLE, SCORES_IN_BASE2, SCORE_AFFINE, OUTPUT_MAX, HAS_SINKS, SCORE_DTYPE, IS_FP8, O_TMA)),
            (consumer, (q_smem, k_bufs, v_bufs, q_bar, k_ready, k_empty, v_ready, v_empty, turns,
                        Out, LSE, MaxScores, DESCALE_V, SINKS, b, h, off_m, n_partial, n_tiles,
                        P_IDX, F_IDX,
                        stride_om, Q_LEN, KV_LEN, SM_SCALE,
                        $score_mod_params $mask_mod_params
                        1, BLOCK_M, BLOCK_N, V_HEAD_DIM, TILES_PER_BLOCK, SPARSE_KV_BLOCK_SIZE, BLOCKS_ARE_CONTIGUOUS,
                        IS_DIVISIBLE, SCORES_IN_BASE2, SCORE_AFFINE, OUTPUT_MAX, HAS_SINKS, SCORE_DTYPE, IS_FP8, O_TMA)),
            (consumer, (q_smem, k_bufs, v_bufs, q_bar, k_ready, k_empty, v_ready, v_empty, turns,
                        Out, LSE, MaxScores, DESCALE_V, SINKS, b, h, off_m, n_partial, n_tiles,
                        P_IDX, F_IDX,
                        stride_om, Q_LEN, KV_LEN, SM_SCALE,
                        $score_mod_params $mask_mod_params
                        2, BLOCK_M, BLOCK_N, V_HEAD_DIM, TILES_PER_BLOCK, SPARSE_KV_BLOCK_SIZE, BLOCKS_ARE_CONTIGUOUS,
                        IS_DIVISIBLE, SCORES_IN_BASE2, SCORE_AFFINE, OUTPUT_MAX, HAS_SINKS, SCORE_DTYPE, IS_FP8, O_TMA)),
            (loader, (Q, K, V, q_smem, k_bufs, v_bufs, q_bar, k_ready, k_empty, v_ready, v_empty,
                      b, h, b_kv, h_kv, off_m, n_partial, n_tiles, P_IDX, F_IDX,
                      TILES_PER_BLOCK, SPARSE_KV_BLOCK_SIZE, BLOCK_N, BLOCKS_ARE_CONTIGUOUS, IS_FP8)),
        ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, 24])
    else:
        gl.warp_specialize([
            (consumer, (q_smem, k_bufs, v_bufs, q_bar, k_ready, k_empty, v_ready, v_empty, turns,
                        Out, LSE, MaxScores, DESCALE_V, SINKS, b, h, off_m, n_partial, n_tiles,
                        P_IDX, F_IDX,
                        stride_om, Q_LEN, KV_LEN, SM_SCALE,
                        $score_mod_params $mask_mod_params
                        0, BLOCK_M, BLOCK_N, V_HEAD_DIM, TILES_PER_BLOCK, SPARSE_KV_BLOCK_SIZE, BLOCKS_ARE_CONTIGUOUS,
                        IS_DIVISIBLE, SCORES_IN_BASE2, SCORE_AFFINE, OUTPUT_MAX, HAS_SINKS, SCORE_DTYPE, IS_FP8, O_TMA)),
            (consumer, (q_smem, k_bufs, v_bufs, q_bar, k_ready, k_empty, v_ready, v_empty, turns,
                        Out, LSE, MaxScores, DESCALE_V, SINKS, b, h, off_m, n_partial, n_tiles,
                        P_IDX, F_IDX,
                        stride_om, Q_LEN, KV_LEN, SM_SCALE,
                        $score_mod_params $mask_mod_params
                        1, BLOCK_M, BLOCK_N, V_HEAD_DIM, TILES_PER_BLOCK, SPARSE_KV_BLOCK_SIZE, BLOCKS_ARE_CONTIGUOUS,
                        IS_DIVISIBLE, SCORES_IN_BASE2, SCORE_AFFINE, OUTPUT_MAX, HAS_SINKS, SCORE_DTYPE, IS_FP8, O_TMA)),
            (loader, (Q, K, V, q_smem, k_bufs, v_bufs, q_bar, k_ready, k_empty, v_ready, v_empty,
                      b, h, b_kv, h_kv, off_m, n_partial, n_tiles, P_IDX, F_IDX,
                      TILES_PER_BLOCK, SPARSE_KV_BLOCK_SIZE, BLOCK_N, BLOCKS_ARE_CONTIGUOUS, IS_FP8)),
        ], [4, 1], [CONSUMER_REGS, 24])
