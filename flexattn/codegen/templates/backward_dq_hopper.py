# The backward's dQ for Hopper (sm_90), bfloat16 / float16, in Gluon: one program per query tile
# walks the forward's KV lists and writes 16-bit dQ once (no float32 accumulator, no atomics, sums
# in a fixed order: deterministic). It pairs with backward_hopper.py compiled without dQ
# (COMPUTE_DQ off), which runs after it and writes dK and dV; together they take the seven products of backward.py's
# two passes, the two recomputed ones (q.k^T and dO.v^T) here. Read backward.py's header for the
# math (P from the saved LSE, Delta, d score_mod / d score).
#
# One program per (query tile of BLOCK_M = 128 rows, batch x query head), forward_hopper.py's
# shape, three partitions:
#   loader      1 warp: TMA copies of the Q and dO tiles once, then of each K and V tile of
#               BLOCK_N rows into a ring of NUM_BUFFERS slots (k_ready / v_ready: "landed";
#               k_empty / v_empty: "both consumers are done with the slot")
#   consumer 0  4 warps (a warp group): query rows 0..63 of the tile
#   consumer 1  4 warps: rows 64..127
# Per KV tile a consumer issues S = Q K^T and dP = dO V^T (asynchronous), waits for S and the
# previous tile's dQ product (then frees that tile's K), forms P = exp2(S / ln 2 - LSE / ln 2)
# (score_mod, mask and lengths as in backward_hopper.py), waits for dP (then frees V), forms
# dS = P (dP - Delta) d score_mod / d score in 16 bits in the registers, and issues dQ += dS K
# with dS as the register operand. The LSE of a consumer's rows is read once.
# The epilogue scales dQ by SM_SCALE and stages it in the consumer's rows of the Q tile, which
# the TMA unit stores (rows past Q_LEN are clipped).
#
# The pass also writes Delta = rowsum(dO * O) - dLSE (each consumer its rows, from the dO tile it
# holds and O read once), which it needs first and backward_hopper.py reads after it: no
# preprocess launch, and dO is read once for both.
#
# PERSISTENT (where backward.persistent_programs says: masks that read captured tensors, whose
# programs are short): one program per SM walks query tiles with two Q/dO buffers, so that a tile's Q and
# dO load during the previous tile's last steps (the K/V ring runs on across tiles) and its dQ
# store runs during the next tile's first: 16 documents +4% at head dim 64, level at 128.
#
# Differences from backward.py's dQ pass: Q, K, V, dO and dQ are TMA descriptors (the host checks
# alignment); E == Ev in (64, 128); no captured-tensor gradients (those calls take backward.py's
# pass); mask work only on partial blocks and on the tile that holds KV_LEN.
$prelude

$score_mod_def

$mask_mod_def

$score_dscore_def


$gluon_tiles

@gluon.jit
def loader(Q, K, V, DO, q_smem, do_smem, k_bufs, v_bufs, q_bar, k_ready, k_empty, v_ready, v_empty,
           b, h, b_kv, h_kv, off_m, n_partial, n_tiles, P_IDX, F_IDX,
           TILES_PER_BLOCK: gl.constexpr, SPARSE_KV_BLOCK_SIZE: gl.constexpr, BLOCK_N: gl.constexpr,
           BLOCKS_ARE_CONTIGUOUS: gl.constexpr):
    # (Q and dO even for a tile that sees no KV block: its Delta is read by the consumers)
    mbarrier.expect(q_bar, Q.block_type.nbytes + DO.block_type.nbytes)
    _tma_load(Q, [b, h, off_m, 0], q_bar, q_smem)
    _tma_load(DO, [b, h, off_m, 0], q_bar, do_smem)
    load_kv_ring(K, V, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty, b_kv, h_kv, n_partial, n_tiles,
                 P_IDX, F_IDX, TILES_PER_BLOCK, SPARSE_KV_BLOCK_SIZE, BLOCK_N, BLOCKS_ARE_CONTIGUOUS, False)


@gluon.jit
def d_scores(s, dp, valid, lse2, delta, b, h, q_idx, kv_idx, SM_SCALE,
             $score_mod_params
             SCORES_IN_BASE2: gl.constexpr, SCORE_DTYPE: gl.constexpr):
    """dS of a tile from its scores and (once ready) dP: P from the saved LSE (base 2), zero where
    not valid, then dS = P (dP - Delta) through score_mod's derivative."""
    if SCORES_IN_BASE2:
        p = gl.where(valid, gl.exp2(s * (SM_SCALE * LOG2E) - lse2), 0.0)
        dp = warpgroup_mma_wait(1, deps=(dp, ))  # (the dQ product issued after it may still run)
        ds = p * (dp - delta)
    else:
        qk = (s * SM_SCALE).to(SCORE_DTYPE)
        t = score_mod(qk, b, h, q_idx, kv_idx, $score_mod_params).to(gl.float32)
        p = gl.where(valid, gl.exp2(t * LOG2E - lse2), 0.0)
        dp = warpgroup_mma_wait(1, deps=(dp, ))
        ds = p * (dp - delta)
        ds = score_mod_dscore(qk, b, h, q_idx, kv_idx, ds, valid, $score_dscore_args).to(gl.float32)
    return ds


@gluon.jit
def out_rows(OUT, rows_start, stride_om, stride_ok, Q_LEN, ROWS: gl.constexpr, HEAD_DIM: gl.constexpr):
    """ROWS rows of the output from rows_start (zeros past Q_LEN), in `row_deltas`' layout."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    rows = rows_start + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout))
    return gl.load(OUT + gl.expand_dims(rows.to(gl.int64) * stride_om, 1) + gl.expand_dims(cols * stride_ok, 0),
                   mask=gl.expand_dims(rows < Q_LEN, 1), other=0.0)


@gluon.jit
def row_deltas(o, do, DLSE, DELTA, rows_start, stride_dlm, Q_LEN, HAS_GRAD_LSE: gl.constexpr):
    """Delta = rowsum(dO * O) - dLSE of the rows `out_rows` gave (``o``; ``do``: their rows of
    the dO tile in shared memory, landed), stored for the dK/dV kernel and returned (one value
    per row)."""
    rows = rows_start + gl.arange(0, o.shape[0], layout=gl.SliceLayout(1, o.type.layout))
    live = rows < Q_LEN
    delta = gl.sum(o.to(gl.float32) * do.load(o.type.layout).to(gl.float32), axis=1)
    if HAS_GRAD_LSE:
        delta -= gl.load(DLSE + rows * stride_dlm, mask=live, other=0.0).to(gl.float32)
    gl.store(DELTA + rows, delta, mask=live)
    return delta


@gluon.jit
def consume_q_tile(q_smem, do_smem, q_bufs, do_bufs, qb, k_bufs, v_bufs, q_bar, q_phase, q_free, release, first,
                   k_ready, k_empty, v_ready, v_empty,
                   DQ, LSE, DELTA, OUT, DLSE, b, h, off_m, n_partial, n_tiles, P_IDX, F_IDX,
                   stride_lm, stride_om, stride_ok, stride_dlm, Q_LEN, KV_LEN, SM_SCALE,
                   $score_mod_params $mask_mod_params
                   WG: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, TILES_PER_BLOCK: gl.constexpr,
                   SPARSE_KV_BLOCK_SIZE: gl.constexpr, BLOCKS_ARE_CONTIGUOUS: gl.constexpr,
                   IS_DIVISIBLE: gl.constexpr, SCORES_IN_BASE2: gl.constexpr, HAS_GRAD_LSE: gl.constexpr,
                   SCORE_DTYPE: gl.constexpr, PERSISTENT: gl.constexpr):
    """One consumer's dQ of the query tile at off_m (its Q and dO in q_smem / do_smem, landed at
    q_bar's phase q_phase), its K/V tiles the ring's from the ``first``-th on: returns the ring's
    count after them. PERSISTENT: q_smem / do_smem are entry qb of q_bufs / do_bufs, dQ's store
    is left in flight, and with ``release`` the previous tile's is waited for first, then q_free
    says its buffers may be refilled."""
    NUM_BUFFERS: gl.constexpr = k_bufs.type.shape[0]
    ROWS: gl.constexpr = BLOCK_M // 2
    dtype: gl.constexpr = k_bufs.dtype
    HEAD_DIM: gl.constexpr = k_bufs.type.shape[4]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEAD_DIM, 16])
    ds_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)

    my_m = off_m + WG * ROWS
    rows = my_m + gl.arange(0, ROWS, layout=row_s)
    q_idx = gl.expand_dims(rows, 1)
    # [Note] a fully masked row has LSE -inf: +inf makes its P exactly 0 (rows past Q_LEN too)
    lse = gl.load(LSE + rows * stride_lm, mask=rows < Q_LEN, other=float("inf"))
    lse2 = gl.expand_dims(gl.where(lse == -float("inf"), float("inf"), lse * LOG2E), 1)
    q = q_smem.reshape([BLOCK_M, HEAD_DIM]).slice(WG * ROWS, ROWS, dim=0)
    do = do_smem.reshape([BLOCK_M, HEAD_DIM]).slice(WG * ROWS, ROWS, dim=0)
    o = out_rows(OUT, my_m, stride_om, stride_ok, Q_LEN, ROWS, HEAD_DIM)  # (in flight while dO lands)
    mbarrier.wait(q_bar, q_phase)
    if PERSISTENT:
        if release:  # (the previous tile's dQ store has read the other Q buffer: refill it)
            tma.store_wait(0)
            _sync_warps()
            mbarrier.arrive(q_free, count=1)
    delta = row_deltas(o, do, DLSE, DELTA, my_m, stride_dlm, Q_LEN, HAS_GRAD_LSE)
    delta = gl.expand_dims(gl.convert_layout(delta, row_s), 1)
    zero_s = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout)
    acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=acc_layout)
    ds_op = gl.zeros([ROWS, BLOCK_N], dtype, layout=ds_layout)

    if n_tiles > 0:
        for j in range(n_tiles):
            slot = (first + j) % NUM_BUFFERS
            phase = ((first + j) // NUM_BUFFERS) & 1
            k = k_bufs.index(slot).reshape([BLOCK_N, HEAD_DIM])
            v = v_bufs.index(slot).reshape([BLOCK_N, HEAD_DIM])
            # the previous tile's K (at the first tile this one's: dS is zero then, and a slot not
            # yet written could hold NaN bits)
            k_prev = k_bufs.index(gl.where(j > 0, (first + j + NUM_BUFFERS - 1) % NUM_BUFFERS, slot))
            if PERSISTENT:
                # (the Q and dO views taken anew each step from an index the compiler cannot prove
                # constant, as in backward_hopper.py: hoisted, their descriptors take registers)
                qb = qb + (j >> 31)
                q_step = q_bufs.index(qb).reshape([BLOCK_M, HEAD_DIM]).slice(WG * ROWS, ROWS, dim=0)
                do_step = do_bufs.index(qb).reshape([BLOCK_M, HEAD_DIM]).slice(WG * ROWS, ROWS, dim=0)
            else:
                q_step = q
                do_step = do
            # -- S = Q K^T, dP = dO V^T, then the previous tile's dQ += dS K (dS from the registers)
            mbarrier.wait(k_ready.index(slot), phase)
            s = warpgroup_mma(q_step, k.permute((1, 0)), zero_s, use_acc=False, is_async=True)
            mbarrier.wait(v_ready.index(slot), phase)
            dp = warpgroup_mma(do_step, v.permute((1, 0)), zero_s, use_acc=False, is_async=True)
            acc = warpgroup_mma(ds_op, k_prev.reshape([BLOCK_N, HEAD_DIM]), acc, is_async=True)
            start = tile_start(j, n_partial, P_IDX, F_IDX, TILES_PER_BLOCK, SPARSE_KV_BLOCK_SIZE, BLOCK_N,
                               BLOCKS_ARE_CONTIGUOUS)
            kv_idx = gl.expand_dims(start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout)), 0)
            if IS_DIVISIBLE:
                masked = j < n_partial
            else:
                masked = (j < n_partial) | (start + BLOCK_N > KV_LEN)
            s = warpgroup_mma_wait(2, deps=(s, ))
            if masked:
                valid = mask_mod(b, h, q_idx, kv_idx, $mask_mod_params) & (kv_idx < KV_LEN)
                ds = d_scores(s, dp, valid, lse2, delta, b, h, q_idx, kv_idx, SM_SCALE, $score_mod_params
                              SCORES_IN_BASE2, SCORE_DTYPE)
            else:
                ds = d_scores(s, dp, True, lse2, delta, b, h, q_idx, kv_idx, SM_SCALE, $score_mod_params
                              SCORES_IN_BASE2, SCORE_DTYPE)
            mbarrier.arrive(v_empty.index(slot), count=1)
            # -- the previous dQ product: its K slot is free, its dS registers too
            acc, ds_op = warpgroup_mma_wait(0, deps=(acc, ds_op))
            if j > 0:
                mbarrier.arrive(k_empty.index((first + j + NUM_BUFFERS - 1) % NUM_BUFFERS), count=1)
            ds_op = gl.convert_layout(ds.to(dtype), ds_layout)
        # -- the last tile's dQ product
        last = (first + n_tiles - 1) % NUM_BUFFERS
        acc = warpgroup_mma(ds_op, k_bufs.index(last).reshape([BLOCK_N, HEAD_DIM]), acc, is_async=True)
        acc, ds_op = warpgroup_mma_wait(0, deps=(acc, ds_op))
        mbarrier.arrive(k_empty.index(last), count=1)

    # -- dQ (scaled) through this consumer's rows of the Q tile (no product reads them any more;
    # a tile that sees no KV block writes zeros)
    q.store((acc * SM_SCALE).to(dtype))
    fence_async_shared()
    _sync_warps()
    _tma_store(DQ, [b, h, my_m, 0], q_smem.slice(WG * ROWS, ROWS, dim=2))
    if not PERSISTENT:
        tma.store_wait(0)
    return first + n_tiles


@gluon.jit
def consumer(q_smem, do_smem, k_bufs, v_bufs, q_bar, k_ready, k_empty, v_ready, v_empty,
             DQ, LSE, DELTA, OUT, DLSE, b, h, off_m, n_partial, n_tiles, P_IDX, F_IDX,
             stride_lm, stride_om, stride_ok, stride_dlm, Q_LEN, KV_LEN, SM_SCALE,
             $score_mod_params $mask_mod_params
             WG: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, TILES_PER_BLOCK: gl.constexpr,
             SPARSE_KV_BLOCK_SIZE: gl.constexpr, BLOCKS_ARE_CONTIGUOUS: gl.constexpr, IS_DIVISIBLE: gl.constexpr,
             SCORES_IN_BASE2: gl.constexpr, HAS_GRAD_LSE: gl.constexpr, SCORE_DTYPE: gl.constexpr):
    consume_q_tile(q_smem, do_smem, q_smem, do_smem, 0, k_bufs, v_bufs, q_bar, 0, q_bar, False, 0,
                   k_ready, k_empty, v_ready, v_empty,
                   DQ, LSE, DELTA, OUT, DLSE, b, h, off_m, n_partial, n_tiles, P_IDX, F_IDX,
                   stride_lm, stride_om, stride_ok, stride_dlm, Q_LEN, KV_LEN, SM_SCALE,
                   $score_mod_params $mask_mod_params
                   WG, BLOCK_M, BLOCK_N, TILES_PER_BLOCK, SPARSE_KV_BLOCK_SIZE, BLOCKS_ARE_CONTIGUOUS, IS_DIVISIBLE,
                   SCORES_IN_BASE2, HAS_GRAD_LSE, SCORE_DTYPE, False)


@gluon.jit
def persistent_loader(Q, K, V, DO, q_bufs, do_bufs, k_bufs, v_bufs, q_ready, q_free, k_ready, k_empty, v_ready,
                      v_empty, KV_NUM_BLKS, KV_IDX, FULL_KV_NUM_BLKS, FULL_KV_IDX,
                      stride_nz, stride_nh, stride_nm, stride_iz, stride_ih, stride_im,
                      stride_fnz, stride_fnh, stride_fnm, stride_fiz, stride_fih, stride_fim,
                      HQ, BATCH, Q_LEN, HEAD_GROUP,
                      SPARSE_Q_BLOCK_SIZE: gl.constexpr, TILES_PER_BLOCK: gl.constexpr,
                      SPARSE_KV_BLOCK_SIZE: gl.constexpr, BLOCK_N: gl.constexpr, GQA_SHARED_HEADS: gl.constexpr,
                      KV_BATCH_BROADCAST: gl.constexpr, HAS_FULL_BLOCKS: gl.constexpr,
                      BLOCKS_ARE_CONTIGUOUS: gl.constexpr):
    """`loader` for this program's query tiles in turn (`tile_order`): a tile's Q and dO into
    one of two buffers once the consumers have stored the dQ of the tile two before, then its K
    and V tiles through the ring, which runs on across tiles."""
    BLOCK_M: gl.constexpr = q_bufs.type.shape[3]
    n_m = gl.cdiv(Q_LEN, BLOCK_M)
    first = 0
    tc = 0
    for lin in range(gl.program_id(0), n_m * BATCH * HQ, gl.num_programs(0)):
        pid_m, pid_bh = tile_order(lin, n_m, BATCH * HQ, HEAD_GROUP)
        b = pid_bh // HQ
        h = pid_bh % HQ
        off_m = pid_m * BLOCK_M
        n_partial, n_tiles, P_IDX, F_IDX = kv_lists(
            KV_NUM_BLKS, KV_IDX, FULL_KV_NUM_BLKS, FULL_KV_IDX, b.to(gl.int64), h, off_m // SPARSE_Q_BLOCK_SIZE,
            stride_nz, stride_nh, stride_nm, stride_iz, stride_ih, stride_im,
            stride_fnz, stride_fnh, stride_fnm, stride_fiz, stride_fih, stride_fim, TILES_PER_BLOCK, HAS_FULL_BLOCKS)
        qb = tc % 2
        mbarrier.wait(q_free.index(qb), ((tc // 2) & 1) ^ 1)
        mbarrier.expect(q_ready.index(qb), Q.block_type.nbytes + DO.block_type.nbytes)
        _tma_load(Q, [b, h, off_m, 0], q_ready.index(qb), q_bufs.index(qb))
        _tma_load(DO, [b, h, off_m, 0], q_ready.index(qb), do_bufs.index(qb))
        load_kv_ring(K, V, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty, 0 if KV_BATCH_BROADCAST else b,
                     h // GQA_SHARED_HEADS, n_partial, n_tiles, P_IDX, F_IDX, TILES_PER_BLOCK, SPARSE_KV_BLOCK_SIZE,
                     BLOCK_N, BLOCKS_ARE_CONTIGUOUS, False, first)
        first += n_tiles
        tc += 1


@gluon.jit
def persistent_consumer(q_bufs, do_bufs, k_bufs, v_bufs, q_ready, q_free, k_ready, k_empty, v_ready, v_empty,
                        DQ, LSE, DELTA, OUT, DLSE, KV_NUM_BLKS, KV_IDX, FULL_KV_NUM_BLKS, FULL_KV_IDX,
                        $score_mod_params $mask_mod_params
                        stride_lz, stride_lh, stride_lm, stride_oz, stride_oh, stride_om, stride_ok,
                        stride_dlz, stride_dlh, stride_dlm,
                        stride_nz, stride_nh, stride_nm, stride_iz, stride_ih, stride_im,
                        stride_fnz, stride_fnh, stride_fnm, stride_fiz, stride_fih, stride_fim,
                        HQ, BATCH, Q_LEN, KV_LEN, HEAD_GROUP, SM_SCALE,
                        WG: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                        SPARSE_Q_BLOCK_SIZE: gl.constexpr, TILES_PER_BLOCK: gl.constexpr,
                        SPARSE_KV_BLOCK_SIZE: gl.constexpr, HAS_FULL_BLOCKS: gl.constexpr,
                        BLOCKS_ARE_CONTIGUOUS: gl.constexpr, IS_DIVISIBLE: gl.constexpr,
                        SCORES_IN_BASE2: gl.constexpr, HAS_GRAD_LSE: gl.constexpr, SCORE_DTYPE: gl.constexpr):
    """`consume_q_tile` for this program's query tiles in turn, as the loader takes them; the
    last tile's dQ store is waited for at the end."""
    n_m = gl.cdiv(Q_LEN, BLOCK_M)
    first = 0
    tc = 0
    for lin in range(gl.program_id(0), n_m * BATCH * HQ, gl.num_programs(0)):
        pid_m, pid_bh = tile_order(lin, n_m, BATCH * HQ, HEAD_GROUP)
        b = pid_bh // HQ
        h = pid_bh % HQ
        off_m = pid_m * BLOCK_M
        b64 = b.to(gl.int64)
        h64 = h.to(gl.int64)
        n_partial, n_tiles, P_IDX, F_IDX = kv_lists(
            KV_NUM_BLKS, KV_IDX, FULL_KV_NUM_BLKS, FULL_KV_IDX, b64, h, off_m // SPARSE_Q_BLOCK_SIZE,
            stride_nz, stride_nh, stride_nm, stride_iz, stride_ih, stride_im,
            stride_fnz, stride_fnh, stride_fnm, stride_fiz, stride_fih, stride_fim, TILES_PER_BLOCK, HAS_FULL_BLOCKS)
        qb = tc % 2
        first = consume_q_tile(q_bufs.index(qb), do_bufs.index(qb), q_bufs, do_bufs, qb, k_bufs, v_bufs,
                               q_ready.index(qb), (tc // 2) & 1, q_free.index(1 - qb), tc > 0, first,
                               k_ready, k_empty, v_ready, v_empty, DQ,
                               LSE + b64 * stride_lz + h64 * stride_lh, DELTA + (b64 * HQ + h) * Q_LEN,
                               OUT + b64 * stride_oz + h64 * stride_oh, DLSE + b64 * stride_dlz + h64 * stride_dlh,
                               b, h, off_m, n_partial, n_tiles, P_IDX, F_IDX,
                               stride_lm, stride_om, stride_ok, stride_dlm, Q_LEN, KV_LEN, SM_SCALE,
                               $score_mod_params $mask_mod_params
                               WG, BLOCK_M, BLOCK_N, TILES_PER_BLOCK, SPARSE_KV_BLOCK_SIZE, BLOCKS_ARE_CONTIGUOUS,
                               IS_DIVISIBLE, SCORES_IN_BASE2, HAS_GRAD_LSE, SCORE_DTYPE, True)
        tc += 1
    tma.store_wait(0)


@gluon.jit
def persistent(Q, K, V, DO, DQ, LSE, DELTA, OUT, DLSE, KV_NUM_BLKS, KV_IDX, FULL_KV_NUM_BLKS, FULL_KV_IDX,
               $score_mod_params $mask_mod_params
               stride_lz, stride_lh, stride_lm, stride_oz, stride_oh, stride_om, stride_ok,
               stride_dlz, stride_dlh, stride_dlm,
               stride_nz, stride_nh, stride_nm, stride_iz, stride_ih, stride_im,
               stride_fnz, stride_fnh, stride_fnm, stride_fiz, stride_fih, stride_fim,
               HQ, BATCH, Q_LEN, KV_LEN, HEAD_GROUP, SM_SCALE,
               BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, SPARSE_Q_BLOCK_SIZE: gl.constexpr,
               SPARSE_KV_BLOCK_SIZE: gl.constexpr, TILES_PER_BLOCK: gl.constexpr, GQA_SHARED_HEADS: gl.constexpr,
               KV_BATCH_BROADCAST: gl.constexpr, HAS_FULL_BLOCKS: gl.constexpr, BLOCKS_ARE_CONTIGUOUS: gl.constexpr,
               IS_DIVISIBLE: gl.constexpr, SCORES_IN_BASE2: gl.constexpr, HAS_GRAD_LSE: gl.constexpr,
               NUM_BUFFERS: gl.constexpr, CONSUMER_REGS: gl.constexpr, SCORE_DTYPE: gl.constexpr):
    """The pass as persistent programs, one per SM, each walking query tiles (`tile_order`) with
    two Q/dO buffers: a tile's Q and dO load during the previous tile's last steps (the K/V ring
    runs on across tiles), and its dQ store runs during the next tile's first."""
    q_bufs = gl.allocate_shared_memory(Q.dtype, [2] + Q.block_type.shape, Q.layout)
    do_bufs = gl.allocate_shared_memory(DO.dtype, [2] + DO.block_type.shape, DO.layout)
    k_bufs = gl.allocate_shared_memory(K.dtype, [NUM_BUFFERS] + K.block_type.shape, K.layout)
    v_bufs = gl.allocate_shared_memory(V.dtype, [NUM_BUFFERS] + V.block_type.shape, V.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_free.index(i), count=2)  # one arrival per consumer
    for i in gl.static_range(NUM_BUFFERS):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(v_empty.index(i), count=2)
    gl.warp_specialize([
        (persistent_consumer, (q_bufs, do_bufs, k_bufs, v_bufs, q_ready, q_free, k_ready, k_empty, v_ready, v_empty,
                               DQ, LSE, DELTA, OUT, DLSE, KV_NUM_BLKS, KV_IDX, FULL_KV_NUM_BLKS, FULL_KV_IDX,
                               $score_mod_params $mask_mod_params
                               stride_lz, stride_lh, stride_lm, stride_oz, stride_oh, stride_om, stride_ok,
                               stride_dlz, stride_dlh, stride_dlm,
                               stride_nz, stride_nh, stride_nm, stride_iz, stride_ih, stride_im,
                               stride_fnz, stride_fnh, stride_fnm, stride_fiz, stride_fih, stride_fim,
                               HQ, BATCH, Q_LEN, KV_LEN, HEAD_GROUP, SM_SCALE,
                               0, BLOCK_M, BLOCK_N, SPARSE_Q_BLOCK_SIZE, TILES_PER_BLOCK, SPARSE_KV_BLOCK_SIZE,
                               HAS_FULL_BLOCKS, BLOCKS_ARE_CONTIGUOUS, IS_DIVISIBLE, SCORES_IN_BASE2, HAS_GRAD_LSE,
                               SCORE_DTYPE)),
        (persistent_consumer, (q_bufs, do_bufs, k_bufs, v_bufs, q_ready, q_free, k_ready, k_empty, v_ready, v_empty,
                               DQ, LSE, DELTA, OUT, DLSE, KV_NUM_BLKS, KV_IDX, FULL_KV_NUM_BLKS, FULL_KV_IDX,
                               $score_mod_params $mask_mod_params
                               stride_lz, stride_lh, stride_lm, stride_oz, stride_oh, stride_om, stride_ok,
                               stride_dlz, stride_dlh, stride_dlm,
                               stride_nz, stride_nh, stride_nm, stride_iz, stride_ih, stride_im,
                               stride_fnz, stride_fnh, stride_fnm, stride_fiz, stride_fih, stride_fim,
                               HQ, BATCH, Q_LEN, KV_LEN, HEAD_GROUP, SM_SCALE,
                               1, BLOCK_M, BLOCK_N, SPARSE_Q_BLOCK_SIZE, TILES_PER_BLOCK, SPARSE_KV_BLOCK_SIZE,
                               HAS_FULL_BLOCKS, BLOCKS_ARE_CONTIGUOUS, IS_DIVISIBLE, SCORES_IN_BASE2, HAS_GRAD_LSE,
                               SCORE_DTYPE)),
        (persistent_loader, (Q, K, V, DO, q_bufs, do_bufs, k_bufs, v_bufs, q_ready, q_free, k_ready, k_empty, v_ready,
                             v_empty, KV_NUM_BLKS, KV_IDX, FULL_KV_NUM_BLKS, FULL_KV_IDX,
                             stride_nz, stride_nh, stride_nm, stride_iz, stride_ih, stride_im,
                             stride_fnz, stride_fnh, stride_fnm, stride_fiz, stride_fih, stride_fim,
                             HQ, BATCH, Q_LEN, HEAD_GROUP, SPARSE_Q_BLOCK_SIZE, TILES_PER_BLOCK,
                             SPARSE_KV_BLOCK_SIZE, BLOCK_N, GQA_SHARED_HEADS, KV_BATCH_BROADCAST, HAS_FULL_BLOCKS,
                             BLOCKS_ARE_CONTIGUOUS)),
    ], [4, 1], [CONSUMER_REGS, 24])


@gluon.jit
def flex_attention_backward_dq(
$flex_attention_backward_dq_params
):
    gl.static_assert(SPARSE_Q_BLOCK_SIZE % BLOCK_M == 0)
    gl.static_assert(SPARSE_KV_BLOCK_SIZE % BLOCK_N == 0)
    TILES_PER_BLOCK: gl.constexpr = SPARSE_KV_BLOCK_SIZE // BLOCK_N
    if PERSISTENT:
        persistent(Q, K, V, DO, DQ, LSE, DELTA, OUT, DLSE, KV_NUM_BLKS, KV_IDX, FULL_KV_NUM_BLKS, FULL_KV_IDX,
                   $score_mod_params $mask_mod_params
                   stride_lz, stride_lh, stride_lm, stride_oz, stride_oh, stride_om, stride_ok,
                   stride_dlz, stride_dlh, stride_dlm,
                   stride_nz, stride_nh, stride_nm, stride_iz, stride_ih, stride_im,
                   stride_fnz, stride_fnh, stride_fnm, stride_fiz, stride_fih, stride_fim,
                   HQ, BATCH, Q_LEN, KV_LEN, HEAD_GROUP, SM_SCALE,
                   BLOCK_M, BLOCK_N, SPARSE_Q_BLOCK_SIZE, SPARSE_KV_BLOCK_SIZE, TILES_PER_BLOCK, GQA_SHARED_HEADS,
                   KV_BATCH_BROADCAST, HAS_FULL_BLOCKS, BLOCKS_ARE_CONTIGUOUS, IS_DIVISIBLE, SCORES_IN_BASE2,
                   HAS_GRAD_LSE, NUM_BUFFERS, CONSUMER_REGS, SCORE_DTYPE)
        return
    pid_m, pid_bh = program_tile(HEAD_GROUP)
    b = pid_bh // HQ
    h = pid_bh % HQ
    h_kv = h // GQA_SHARED_HEADS
    b_kv = 0 if KV_BATCH_BROADCAST else b
    off_m = pid_m * BLOCK_M
    b64 = b.to(gl.int64)
    LSE += b64 * stride_lz + h.to(gl.int64) * stride_lh
    DELTA += (b64 * HQ + h) * Q_LEN
    OUT += b64 * stride_oz + h.to(gl.int64) * stride_oh
    DLSE += b64 * stride_dlz + h.to(gl.int64) * stride_dlh

    n_partial, n_tiles, P_IDX, F_IDX = kv_lists(
        KV_NUM_BLKS, KV_IDX, FULL_KV_NUM_BLKS, FULL_KV_IDX, b64, h, off_m // SPARSE_Q_BLOCK_SIZE,
        stride_nz, stride_nh, stride_nm, stride_iz, stride_ih, stride_im,
        stride_fnz, stride_fnh, stride_fnm, stride_fiz, stride_fih, stride_fim, TILES_PER_BLOCK, HAS_FULL_BLOCKS)

    q_smem = gl.allocate_shared_memory(Q.dtype, Q.block_type.shape, Q.layout)
    do_smem = gl.allocate_shared_memory(DO.dtype, DO.block_type.shape, DO.layout)
    k_bufs = gl.allocate_shared_memory(K.dtype, [NUM_BUFFERS] + K.block_type.shape, K.layout)
    v_bufs = gl.allocate_shared_memory(V.dtype, [NUM_BUFFERS] + V.block_type.shape, V.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(NUM_BUFFERS):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)  # one arrival per consumer
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(v_empty.index(i), count=2)

    gl.warp_specialize([
        (consumer, (q_smem, do_smem, k_bufs, v_bufs, q_bar, k_ready, k_empty, v_ready, v_empty,
                    DQ, LSE, DELTA, OUT, DLSE, b, h, off_m, n_partial, n_tiles, P_IDX, F_IDX,
                    stride_lm, stride_om, stride_ok, stride_dlm, Q_LEN, KV_LEN, SM_SCALE,
                    $score_mod_params $mask_mod_params
                    0, BLOCK_M, BLOCK_N, TILES_PER_BLOCK, SPARSE_KV_BLOCK_SIZE, BLOCKS_ARE_CONTIGUOUS,
                    IS_DIVISIBLE, SCORES_IN_BASE2, HAS_GRAD_LSE, SCORE_DTYPE)),
        (consumer, (q_smem, do_smem, k_bufs, v_bufs, q_bar, k_ready, k_empty, v_ready, v_empty,
                    DQ, LSE, DELTA, OUT, DLSE, b, h, off_m, n_partial, n_tiles, P_IDX, F_IDX,
                    stride_lm, stride_om, stride_ok, stride_dlm, Q_LEN, KV_LEN, SM_SCALE,
                    $score_mod_params $mask_mod_params
                    1, BLOCK_M, BLOCK_N, TILES_PER_BLOCK, SPARSE_KV_BLOCK_SIZE, BLOCKS_ARE_CONTIGUOUS,
                    IS_DIVISIBLE, SCORES_IN_BASE2, HAS_GRAD_LSE, SCORE_DTYPE)),
        (loader, (Q, K, V, DO, q_smem, do_smem, k_bufs, v_bufs, q_bar, k_ready, k_empty, v_ready, v_empty,
                  b, h, b_kv, h_kv, off_m, n_partial, n_tiles, P_IDX, F_IDX,
                  TILES_PER_BLOCK, SPARSE_KV_BLOCK_SIZE, BLOCK_N, BLOCKS_ARE_CONTIGUOUS)),
    ], [4, 1], [CONSUMER_REGS, 24])
