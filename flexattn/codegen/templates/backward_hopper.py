# Block-sparse attention backward for Hopper (sm_90), bfloat16 / float16, in Gluon: dK and dV of a
# KV tile and its share of dQ in one pass, five matrix multiplies per step where backward.py's two
# passes take seven (they recompute q.k^T and dO.v^T). Read backward.py's header for the math
# (P from the saved LSE, Delta, d score_mod / d score) and the tables; this kernel computes the same.
#
# One program per (KV tile of BLOCK_N = 128 rows, batch x KV head), three partitions:
#   loader      1 warp: TMA copies of the K and V tiles once, then, for every query head of the GQA
#               group and every query tile of BLOCK_M = 64 rows that sees this KV tile (the
#               transposed lists), the Q and dO tiles into a ring of NUM_BUFFERS slots (q_ready /
#               do_ready: "landed"; q_empty / do_empty: "both consumers are done with it")
#   consumer 0  4 warps (a warp group): KV rows 0..63 of the tile
#   consumer 1  4 warps: KV rows 64..127
# One KV tile per program, also where its programs are short (16 documents: 8 to 16 steps each):
# programs that walked 2 or 4 consecutive KV tiles of one head, their K and V loaded once the last
# tile's dV had left V's rows (the shared memory has no room for a second K/V tile), ran 7% and
# 12% slower on 16 documents at S=8k, 11% and 15% at 16k, 10% and 15% on sliding window 1024, and
# level to 3% faster at head dim 64 (H100, dK/dV without dQ, outputs bitwise those of one tile
# per program): fewer, longer programs leave a longer tail, and the next tile's loads still
# waited for the last one's stores. PERSISTENT (COMPUTE_DQ off, where backward.persistent_programs
# says: masks that read captured tensors) does load the next tile during the last steps: one
# program per SM walks the tiles with two K/V buffers (room made by staging dK in K's rows instead
# of dQ buffers, and one dS buffer), 16 documents +2% at head dim 128 and +6% at 64.
# Per query tile a consumer, with w its 64 KV rows:
#   S = Q K_w^T, dP = dO V_w^T                 (asynchronous; see LATE_DP_WAIT for P's exp2)
#   P = exp2(S / ln 2 - LSE / ln 2),  dS = P (dP - Delta) d score_mod / d score
#                                              (SCORE_AFFINE, forward.py: exp2 of q.k c + u(kv_idx) -
#                                              (LSE / ln 2 - w(q_idx)), positions relative to the query
#                                              tile's first row)
#   P, dS -> shared memory (p_bufs, ds_bufs)  the A operands below, read transposed
#   dV_w += P^T dO,  dK_w += dS^T Q
#   dQ = dS K * SM_SCALE                       a half of the columns per consumer, over both
#                                              consumers' dS (they meet at ds_ready)
#   dQ -> shared memory -> the float32 DQ_ACC by a TMA reduce-add (dq_bufs, one per consumer; the
#   next step's store waits until the TMA unit has read it). dK += dS^T Q runs during the add.
# DEFER_DQ (kernels/backward.py's defer_dq says where): a step's dQ is computed in the next step, so
# a consumer waits for the other's dS a step later instead of at once (where their work per step
# differs, a mask's or a score_mod's, neither idles for the other). The two dS buffers are then
# read a step after they are written: a step waits (ds_free) until both consumers' dQ products
# have read the buffer its dS store takes.
# The preprocess zeroes DQ_ACC and the host converts it to the query's dtype afterwards; dK is
# scaled in-program. COMPUTE_DQ off (kernels/backward.py's dq_by_pass: deterministic mode, captured
# tensors that need gradients, the tuner's choice): no dQ product and no add, each consumer reads
# only its own dS, and a dQ pass writes dQ (backward_dq_hopper.py, which runs first and writes
# Delta, or backward.py's where captured tensors need gradients).
# DQ_ORDERED (deterministic mode, kernels/backward.py's ordered_dq): the dQ adds into each dQ tile
# come in a fixed order, that of the KV tiles of the programs that visit it (the order the hardware
# starts programs in, so a program only ever waits for one already running or done). A fourth
# partition, one warp (dq_writer), issues them: the consumers hand their dQ halves over
# (dq_full / dq_empty) and go on; the writer waits until the tile's count in DQ_SEM reaches its
# program's rank (the host's ranked lists, tables.ordered_q_lists), adds, and raises the count once
# the add has completed. Every program walks its query tiles from the last, so that under causal-like
# masks a program reaches a tile no earlier than the programs of lower KV tiles, and the lists merge
# partial and full blocks (each entry flagged) so that the walk is in query order. Outside
# deterministic mode none of this is compiled in.
# 16-bit dK and dV (DKV_TMA: K/V not broadcast over the batch, whose gradients
# the host sums in float32) leave through the TMA unit, each consumer's staged in its own shared
# memory (dV in its rows of the V tile, dK in its dQ buffer): 16 documents 7-10% faster, S=2k 3-5%
# (python -m benchmarks attention). Staging dK in the K tile's rows instead needs both consumers past their
# last dQ product (which reads all of K), and that wait cost sliding window 2-5%.
# Why TMA: one thread's relaxed atomics per element of dQ (four billion at B=4 H=16 S=8k D=128)
# saturate the L2's reduction units (the same kernel without their memory traffic ran 1.45x
# faster); the TMA unit's bulk reduce-add does the same adds at line granularity.
#
# Differences from backward.py: Q, K, V, dO and DQ_ACC are TMA descriptors (the host checks
# alignment; rows past a length read zeros and are not written); E == Ev in (64, 128); no
# captured-tensor gradients (those calls take backward.py); mask work (mask_mod and the length
# bounds) only on partial blocks and on the tiles that cross Q_LEN or KV_LEN.
$prelude

$score_mod_def

$mask_mod_def

$score_dscore_def


$gluon_tiles

from triton._C.libtriton import ir  # noqa: E402
from triton.experimental.gluon.language._core import builtin  # noqa: E402


@builtin
def _tma_add_36(tensor_desc, coord, src, _semantic=None):
    # triton 3.6 has the TMA reduce-add operation but not its Gluon function (3.9: tma.async_atomic_add)
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


_tma_add = getattr(tma, "async_atomic_add", None) or _tma_add_36


@builtin
def _reinterpret(mem, dtype, shape, layout, _semantic=None):
    # shared memory viewed as another dtype, shape and layout (triton 3.6 _reinterpret, 3.9 reinterpret)
    view = getattr(mem, "reinterpret", None) or mem._reinterpret
    return view(dtype, shape, layout, _semantic=_semantic)


@gluon.jit
def q_lists(Q_NUM_BLKS, Q_IDX, FULL_Q_NUM_BLKS, FULL_Q_IDX, b, h, kv_blk,
            stride_nz, stride_nh, stride_nn, stride_iz, stride_ih, stride_in,
            stride_fnz, stride_fnh, stride_fnn, stride_fiz, stride_fih, stride_fin,
            TILES_PER_BLOCK: gl.constexpr, HAS_FULL_BLOCKS: gl.constexpr):
    """(partial tiles, all tiles, partial list, full list) of query head h for KV block kv_blk:
    `kv_lists`' row lookup in the transposed lists."""
    return kv_lists(Q_NUM_BLKS, Q_IDX, FULL_Q_NUM_BLKS, FULL_Q_IDX, b.to(gl.int64), h, kv_blk,
                    stride_nz, stride_nh, stride_nn, stride_iz, stride_ih, stride_in,
                    stride_fnz, stride_fnh, stride_fnn, stride_fiz, stride_fih, stride_fin,
                    TILES_PER_BLOCK, HAS_FULL_BLOCKS)


@gluon.jit
def q_tile(j, n_partial, P_IDX, F_IDX, TILES_PER_BLOCK: gl.constexpr, SPARSE_Q_BLOCK_SIZE: gl.constexpr,
           BLOCK_M: gl.constexpr, BLOCKS_ARE_CONTIGUOUS: gl.constexpr, DQ_ORDERED: gl.constexpr):
    """(first row, rank, partial) of the j-th query tile of a program's lists (`tile_start`):
    whether its block needs mask work. DQ_ORDERED: one list, each entry's query block in bits
    0-14, its partial flag in bit 15 and above them the rank of this program's KV block among the
    blocks that visit that query block (`tables.ordered_q_lists`); otherwise the rank is 0."""
    if DQ_ORDERED:
        if j < n_partial:
            IDX = P_IDX
            t = j
        else:  # (no full lists but the dense table's)
            IDX = F_IDX
            t = j - n_partial
        if BLOCKS_ARE_CONTIGUOUS:
            entry = gl.load(IDX)
            start = (entry & 0x7FFF) * SPARSE_Q_BLOCK_SIZE + t * BLOCK_M
        else:
            entry = gl.load(IDX + t // TILES_PER_BLOCK)
            start = (entry & 0x7FFF) * SPARSE_Q_BLOCK_SIZE + (t % TILES_PER_BLOCK) * BLOCK_M
        rank = entry >> 16
        partial = (entry & 0x8000) != 0
    else:
        start = tile_start(j, n_partial, P_IDX, F_IDX, TILES_PER_BLOCK, SPARSE_Q_BLOCK_SIZE, BLOCK_M,
                           BLOCKS_ARE_CONTIGUOUS)
        rank = 0
        partial = j < n_partial
    return start, rank, partial


@gluon.jit
def load_tile(Q, K, V, DO, k_smem, v_smem, q_bufs, do_bufs, kv_bar, it, q_ready, q_empty, do_ready, do_empty,
              Q_NUM_BLKS, Q_IDX, FULL_Q_NUM_BLKS, FULL_Q_IDX,
              stride_nz, stride_nh, stride_nn, stride_iz, stride_ih, stride_in,
              stride_fnz, stride_fnh, stride_fnn, stride_fiz, stride_fih, stride_fin,
              b, b_kv, h_kv, off_n, kv_blk,
              GQA_SHARED_HEADS: gl.constexpr, TILES_PER_BLOCK: gl.constexpr, SPARSE_Q_BLOCK_SIZE: gl.constexpr,
              BLOCK_M: gl.constexpr, HAS_FULL_BLOCKS: gl.constexpr, BLOCKS_ARE_CONTIGUOUS: gl.constexpr,
              DQ_ORDERED: gl.constexpr):
    """The KV tile at off_n into k_smem / v_smem (landing on kv_bar), then its query tiles' Q and
    dO through the ring, steps counted from ``it`` (DQ_ORDERED: from the last tile of each list,
    as the consumers take them): returns the count after them."""
    NUM_BUFFERS: gl.constexpr = q_bufs.type.shape[0]
    mbarrier.expect(kv_bar, K.block_type.nbytes + V.block_type.nbytes)
    _tma_load(K, [b_kv, h_kv, off_n, 0], kv_bar, k_smem)
    _tma_load(V, [b_kv, h_kv, off_n, 0], kv_bar, v_smem)
    for g in range(GQA_SHARED_HEADS):
        h = h_kv * GQA_SHARED_HEADS + g
        n_partial, n_tiles, P_IDX, F_IDX = q_lists(
            Q_NUM_BLKS, Q_IDX, FULL_Q_NUM_BLKS, FULL_Q_IDX, b, h, kv_blk,
            stride_nz, stride_nh, stride_nn, stride_iz, stride_ih, stride_in,
            stride_fnz, stride_fnh, stride_fnn, stride_fiz, stride_fih, stride_fin, TILES_PER_BLOCK, HAS_FULL_BLOCKS)
        for step in range(n_tiles):
            slot = it % NUM_BUFFERS
            phase = (it // NUM_BUFFERS) & 1
            j = n_tiles - 1 - step if DQ_ORDERED else step
            start, _, _ = q_tile(j, n_partial, P_IDX, F_IDX, TILES_PER_BLOCK, SPARSE_Q_BLOCK_SIZE, BLOCK_M,
                                 BLOCKS_ARE_CONTIGUOUS, DQ_ORDERED)
            # a fresh barrier counts as having completed the phase before phase 0: the first round passes
            mbarrier.wait(q_empty.index(slot), phase ^ 1)
            mbarrier.expect(q_ready.index(slot), Q.block_type.nbytes)
            _tma_load(Q, [b, h, start, 0], q_ready.index(slot), q_bufs.index(slot))
            mbarrier.wait(do_empty.index(slot), phase ^ 1)
            mbarrier.expect(do_ready.index(slot), DO.block_type.nbytes)
            _tma_load(DO, [b, h, start, 0], do_ready.index(slot), do_bufs.index(slot))
            it += 1
    return it


@gluon.jit
def loader(Q, K, V, DO, k_smem, v_smem, q_bufs, do_bufs, kv_bar, q_ready, q_empty, do_ready, do_empty,
           Q_NUM_BLKS, Q_IDX, FULL_Q_NUM_BLKS, FULL_Q_IDX,
           stride_nz, stride_nh, stride_nn, stride_iz, stride_ih, stride_in,
           stride_fnz, stride_fnh, stride_fnn, stride_fiz, stride_fih, stride_fin,
           b, b_kv, h_kv, off_n, kv_blk,
           GQA_SHARED_HEADS: gl.constexpr, TILES_PER_BLOCK: gl.constexpr, SPARSE_Q_BLOCK_SIZE: gl.constexpr,
           BLOCK_M: gl.constexpr, HAS_FULL_BLOCKS: gl.constexpr, BLOCKS_ARE_CONTIGUOUS: gl.constexpr,
           DQ_ORDERED: gl.constexpr):
    load_tile(Q, K, V, DO, k_smem, v_smem, q_bufs, do_bufs, kv_bar, gl.program_id(0) * 0, q_ready, q_empty, do_ready,
              do_empty, Q_NUM_BLKS, Q_IDX, FULL_Q_NUM_BLKS, FULL_Q_IDX,
              stride_nz, stride_nh, stride_nn, stride_iz, stride_ih, stride_in,
              stride_fnz, stride_fnh, stride_fnn, stride_fiz, stride_fih, stride_fin,
              b, b_kv, h_kv, off_n, kv_blk,
              GQA_SHARED_HEADS, TILES_PER_BLOCK, SPARSE_Q_BLOCK_SIZE, BLOCK_M, HAS_FULL_BLOCKS, BLOCKS_ARE_CONTIGUOUS,
              DQ_ORDERED)


@gluon.jit
def persistent_loader(Q, K, V, DO, k_bufs, v_bufs, q_bufs, do_bufs, kv_ready, kv_empty, q_ready, q_empty, do_ready,
                      do_empty, Q_NUM_BLKS, Q_IDX, FULL_Q_NUM_BLKS, FULL_Q_IDX,
                      stride_nz, stride_nh, stride_nn, stride_iz, stride_ih, stride_in,
                      stride_fnz, stride_fnh, stride_fnn, stride_fiz, stride_fih, stride_fin,
                      HKV, BATCH, KV_LEN, HEAD_GROUP,
                      GQA_SHARED_HEADS: gl.constexpr, TILES_PER_BLOCK: gl.constexpr, SPARSE_Q_BLOCK_SIZE: gl.constexpr,
                      SPARSE_KV_BLOCK_SIZE: gl.constexpr, BLOCK_M: gl.constexpr, HAS_FULL_BLOCKS: gl.constexpr,
                      BLOCKS_ARE_CONTIGUOUS: gl.constexpr, KV_BATCH_BROADCAST: gl.constexpr):
    """`load_tile` for this program's KV tiles in turn (`tile_order`), into two K/V buffers: a
    tile's K and V load once the consumers have stored the gradients of the tile two before."""
    BLOCK_N: gl.constexpr = k_bufs.type.shape[3]
    n_tiles = gl.cdiv(KV_LEN, BLOCK_N)
    it = 0
    tc = 0
    for lin in range(gl.program_id(0), n_tiles * BATCH * HKV, gl.num_programs(0)):
        pid_n, pid_bh = tile_order(lin, n_tiles, BATCH * HKV, HEAD_GROUP)
        b = pid_bh // HKV
        off_n = pid_n * BLOCK_N
        kb = tc % 2
        mbarrier.wait(kv_empty.index(kb), ((tc // 2) & 1) ^ 1)
        it = load_tile(Q, K, V, DO, k_bufs.index(kb), v_bufs.index(kb), q_bufs, do_bufs, kv_ready.index(kb), it,
                       q_ready, q_empty, do_ready, do_empty, Q_NUM_BLKS, Q_IDX, FULL_Q_NUM_BLKS, FULL_Q_IDX,
                       stride_nz, stride_nh, stride_nn, stride_iz, stride_ih, stride_in,
                       stride_fnz, stride_fnh, stride_fnn, stride_fiz, stride_fih, stride_fin,
                       b, 0 if KV_BATCH_BROADCAST else b, pid_bh % HKV, off_n, off_n // SPARSE_KV_BLOCK_SIZE,
                       GQA_SHARED_HEADS, TILES_PER_BLOCK, SPARSE_Q_BLOCK_SIZE, BLOCK_M, HAS_FULL_BLOCKS,
                       BLOCKS_ARE_CONTIGUOUS, False)
        tc += 1


@gluon.jit
def tile_valid(partial, b, h, q_idx, kv_idx, Q_LEN, KV_LEN, $mask_kv_args $mask_mod_params):
    """Which scores of a tile that needs mask work count: mask_mod on a partial block's tile, and
    the lengths."""
    if partial:
        valid = mask_mod(b, h, q_idx, kv_idx, $mask_kv_args $mask_mod_params) & (q_idx < Q_LEN) & (kv_idx < KV_LEN)
    else:
        valid = (q_idx < Q_LEN) & (kv_idx < KV_LEN)
    return valid


@gluon.jit
def p_and_ds(s, dp, valid, lse2, delta, b, h, q_idx, kv_idx, SM_SCALE, qk_factor, kv_term, ds_factor,
             $score_mod_params $mask_mod_params
             SCORES_IN_BASE2: gl.constexpr, SCORE_AFFINE: gl.constexpr, SCORE_DTYPE: gl.constexpr):
    """P from the scores and the saved LSE (base 2), zero where not valid; then, once dP is
    ready, dS through score_mod's derivative. SCORE_AFFINE: lse2 holds LSE - w(q_idx) (base 2),
    kv_term is u(kv_idx), ds_factor the derivative."""
    if SCORE_AFFINE:
        p = gl.where(valid, gl.exp2(s * qk_factor + kv_term - lse2), 0.0)
        dp = warpgroup_mma_wait(0, deps=(dp, ))
        ds = p * (dp - delta) * ds_factor
    elif SCORES_IN_BASE2:
        p = gl.where(valid, gl.exp2(s * (SM_SCALE * LOG2E) - lse2), 0.0)
        dp = warpgroup_mma_wait(0, deps=(dp, ))
        ds = p * (dp - delta)
    else:
        qk = (s * SM_SCALE).to(SCORE_DTYPE)
        s = score_mod(qk, b, h, q_idx, kv_idx, $score_mod_params).to(gl.float32)
        p = gl.where(valid, gl.exp2(s * LOG2E - lse2), 0.0)
        dp = warpgroup_mma_wait(0, deps=(dp, ))
        ds = p * (dp - delta)
        ds = score_mod_dscore(qk, b, h, q_idx, kv_idx, ds, valid, $score_dscore_args).to(gl.float32)
    return p, ds


@gluon.jit
def dq_add(dq, dq_s, dq_smem, DQ_DESC, b, h, start, dq_full, dq_empty, n_adds, DQ_COL0: gl.constexpr,
           DQ_ORDERED: gl.constexpr):
    """dQ through shared memory into DQ_ACC by the TMA unit's reduce-add (rows past Q_LEN are
    clipped); per-element atomics from the registers run at 0.8x of this (L2-bound). DQ_ORDERED:
    the buffer is handed over to `dq_writer` (dq_full), which adds it, once the writer has read
    the previous one (dq_empty). Returns the count of tiles handed over."""
    if DQ_ORDERED:
        mbarrier.wait(dq_empty, (n_adds & 1) ^ 1)
    else:
        tma.store_wait(0)  # (the previous add has read the buffer)
    dq_s.store(dq)
    fence_async_shared()
    _sync_warps()
    if DQ_ORDERED:
        mbarrier.arrive(dq_full, count=1)
    else:
        _tma_add(DQ_DESC, [b, h, start, DQ_COL0], dq_smem)
    return n_adds + 1


@gluon.jit
def _await_count(ptr, rank):
    """Until the int32 at ptr reads ``rank`` (acquire), then ordered before the async proxy's adds."""
    seen = gl.inline_asm_elementwise("ld.global.acquire.gpu.b32 $$0, [$$1];", "=r,l", [ptr], dtype=gl.int32,
                                     is_pure=False, pack=1)
    while seen != rank:
        seen = gl.inline_asm_elementwise("ld.global.acquire.gpu.b32 $$0, [$$1];", "=r,l", [ptr], dtype=gl.int32,
                                         is_pure=False, pack=1)
    gl.inline_asm_elementwise("fence.proxy.async.global;\n\tmov.u32 $$0, 0;", "=r,l", [ptr], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def _count_up_when_complete(ptr):
    """Once this warp's TMA adds have completed (their writes made, not only their shared memory
    read: cp.async.bulk.wait_group without .read), lane 0 adds 1 to the int32 at ptr (release)."""
    gl.inline_asm_elementwise("cp.async.bulk.wait_group 0;\n\tfence.proxy.async.global;\n\tmov.u32 $$0, 0;",
                              "=r,l", [ptr], dtype=gl.int32, is_pure=False, pack=1)
    _sync_warps()
    gl.inline_asm_elementwise("""{
        .reg .pred p;
        .reg .b32 lane;
        mov.u32 lane, %laneid;
        setp.eq.b32 p, lane, 0;
        @p red.release.gpu.global.add.s32 [$$1], 1;
        mov.u32 $$0, 0;
    }""", "=r,l", [ptr], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def dq_writer(DQ_DESC, dq_bufs, dq_full, dq_empty, DQ_SEM, Q_NUM_BLKS, Q_IDX, FULL_Q_NUM_BLKS, FULL_Q_IDX,
              stride_nz, stride_nh, stride_nn, stride_iz, stride_ih, stride_in,
              stride_fnz, stride_fnh, stride_fnn, stride_fiz, stride_fih, stride_fin,
              b, h_kv, kv_blk, kv_sub, HQ, Q_LEN,
              GQA_SHARED_HEADS: gl.constexpr, TILES_PER_BLOCK: gl.constexpr, KV_TILES_PER_BLOCK: gl.constexpr,
              SPARSE_Q_BLOCK_SIZE: gl.constexpr, BLOCK_M: gl.constexpr, HAS_FULL_BLOCKS: gl.constexpr,
              BLOCKS_ARE_CONTIGUOUS: gl.constexpr):
    """DQ_ORDERED (deterministic mode): one warp adds the consumers' dQ tiles (both halves, handed
    over in `dq_add`) into DQ_ACC in each tile's fixed order. The programs that visit a dQ
    tile add in the order of their KV tiles (the order the hardware starts them in, so that a
    program only waits for programs already running or done): DQ_SEM counts each tile's adds, and
    this program's add waits until the count reaches its rank (`tables.ordered_q_lists`; the
    query tiles walked from the last, as the loader and consumers take them: under causal-like
    masks the programs of lower KV tiles reach a query tile at the same step or earlier). The
    count is raised once the add has completed; the consumers only wait for the buffers."""
    DQ_COLS: gl.constexpr = DQ_DESC.block_type.shape[3]
    n_m = gl.cdiv(Q_LEN, SPARSE_Q_BLOCK_SIZE) * TILES_PER_BLOCK  # (a block's last tile may start past Q_LEN)
    k = 0
    for g in range(GQA_SHARED_HEADS):
        h = h_kv * GQA_SHARED_HEADS + g
        n_partial, n_tiles, P_IDX, F_IDX = q_lists(
            Q_NUM_BLKS, Q_IDX, FULL_Q_NUM_BLKS, FULL_Q_IDX, b, h, kv_blk,
            stride_nz, stride_nh, stride_nn, stride_iz, stride_ih, stride_in,
            stride_fnz, stride_fnh, stride_fnn, stride_fiz, stride_fih, stride_fin, TILES_PER_BLOCK, HAS_FULL_BLOCKS)
        for step in range(n_tiles):
            start, rank, _ = q_tile(n_tiles - 1 - step, n_partial, P_IDX, F_IDX, TILES_PER_BLOCK, SPARSE_Q_BLOCK_SIZE,
                                    BLOCK_M, BLOCKS_ARE_CONTIGUOUS, True)
            count = DQ_SEM + (b * HQ + h) * n_m + start // BLOCK_M
            mbarrier.wait(dq_full, k & 1)
            _await_count(count, rank * KV_TILES_PER_BLOCK + kv_sub)
            _tma_add(DQ_DESC, [b, h, start, 0], dq_bufs.index(0))
            _tma_add(DQ_DESC, [b, h, start, DQ_COLS], dq_bufs.index(1))
            tma.store_wait(0)
            mbarrier.arrive(dq_empty, count=1)
            _count_up_when_complete(count)
            k += 1


@gluon.jit
def consume_tile(k_smem, v_smem, k_bufs, v_bufs, kb, q_bufs, do_bufs, p_bufs, ds_bufs, dq_bufs, DQ_DESC, dq_full,
                 dq_empty, kv_bar, kv_phase, kv_free, release, it, q_ready, q_empty, do_ready, do_empty, ds_ready,
                 ds_free, LSE, DELTA, DK, DV,
                 Q_NUM_BLKS, Q_IDX, FULL_Q_NUM_BLKS, FULL_Q_IDX,
                 $score_mod_params $mask_mod_params
                 stride_lz, stride_lh, stride_lm,
                 stride_dkz, stride_dkh, stride_dkn, stride_dvz, stride_dvh, stride_dvn,
                 stride_nz, stride_nh, stride_nn, stride_iz, stride_ih, stride_in,
                 stride_fnz, stride_fnh, stride_fnn, stride_fiz, stride_fih, stride_fin,
                 b, h_kv, off_n, kv_blk, HQ, Q_LEN, KV_LEN, SM_SCALE,
                 WG: gl.constexpr, GQA_SHARED_HEADS: gl.constexpr, TILES_PER_BLOCK: gl.constexpr,
                 SPARSE_Q_BLOCK_SIZE: gl.constexpr, BLOCK_M: gl.constexpr, HAS_FULL_BLOCKS: gl.constexpr,
                 BLOCKS_ARE_CONTIGUOUS: gl.constexpr, IS_DIVISIBLE: gl.constexpr, SCORES_IN_BASE2: gl.constexpr,
                 SCORE_AFFINE: gl.constexpr, LATE_DP_WAIT: gl.constexpr, SCORE_DTYPE: gl.constexpr,
                 DEFER_DQ: gl.constexpr, DKV_TMA: gl.constexpr, COMPUTE_DQ: gl.constexpr, PERSISTENT: gl.constexpr,
                 DQ_ORDERED: gl.constexpr):
    """One consumer's work on the KV tile at off_n (its K and V in k_smem / v_smem, landed at
    kv_bar's phase kv_phase), its steps counted from ``it``: returns the count after them.
    PERSISTENT: k_smem / v_smem are entry kb of k_bufs / v_bufs; dK is staged in the consumer's
    rows of the K tile, and its stores are left in flight; ``release``: the previous tile's are
    waited for first, then kv_free says its buffers may be refilled. DQ_ORDERED: the query tiles
    walked from the last, each dQ handed over to `dq_writer` (dq_full / dq_empty)."""
    NUM_BUFFERS: gl.constexpr = q_bufs.type.shape[0]
    DS_BUFFERS: gl.constexpr = ds_bufs.type.shape[0]
    BLOCK_N: gl.constexpr = k_smem.type.shape[2]
    HEAD_DIM: gl.constexpr = k_smem.type.shape[3]
    ROWS: gl.constexpr = BLOCK_N // 2
    # dQ = dS K split between the consumers by columns: each a half of the head dim, summing over
    # both consumers' dS (they meet at ds_ready). The host lays K out so that a half is whole
    # swizzle rows (64-byte swizzle at head dim 64). Split by KV rows instead (each consumer dS_w
    # K_w over its own rows) the TMA unit adds twice as much: 285 against 500 TF/s at head dim
    # 128, level to 7% slower at 64 (python -m benchmarks attention)
    DQ_COLS: gl.constexpr = HEAD_DIM // 2
    DQ_COL0: gl.constexpr = WG * DQ_COLS  # this consumer's first dQ column
    dtype: gl.constexpr = k_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, ROWS, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEAD_DIM, 16])
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, DQ_COLS, 16])
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)

    my_n = off_n + WG * ROWS
    kv_idx = gl.expand_dims(my_n + gl.arange(0, ROWS, layout=gl.SliceLayout(0, s_layout)), 0)
    k_all = k_smem.reshape([BLOCK_N, HEAD_DIM])
    k_w = k_all.slice(WG * ROWS, ROWS, dim=0)
    v_w = v_smem.reshape([BLOCK_N, HEAD_DIM]).slice(WG * ROWS, ROWS, dim=0)
    k_dq = k_all.slice(DQ_COL0, DQ_COLS, dim=1)
    p_s = p_bufs.index(WG)
    dq_smem = dq_bufs.index(WG)
    if COMPUTE_DQ:
        dq_s = dq_smem.reshape([BLOCK_M, DQ_COLS])
    kv_edge = off_n + BLOCK_N > KV_LEN
    dk = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=acc_layout)
    dv = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=acc_layout)
    zero_s = gl.zeros([BLOCK_M, ROWS], gl.float32, layout=s_layout)
    zero_dq = gl.zeros([BLOCK_M, DQ_COLS], gl.float32, layout=dq_layout)
    b64 = b.to(gl.int64)

    mbarrier.wait(kv_bar, kv_phase)
    if PERSISTENT:
        if release:  # (the previous tile's dK and dV stores have read the other buffers: refill them)
            tma.store_wait(0)
            _sync_warps()
            mbarrier.arrive(kv_free, count=1)
    prev_start = 0  # DEFER_DQ: the previous step's query tile and head
    prev_h = h_kv * GQA_SHARED_HEADS
    n_adds = 0  # the dQ tiles added (DQ_ORDERED: handed over)
    for g in range(GQA_SHARED_HEADS):
        h = h_kv * GQA_SHARED_HEADS + g
        h64 = h.to(gl.int64)
        LSEh = LSE + b64 * stride_lz + h64 * stride_lh
        DELTAh = DELTA + (b64 * HQ + h64) * Q_LEN
        # mask_mod's values that depend on this KV tile and head only (doc[kv_idx]), read once here
        $mask_kv_call
        qk_factor = SM_SCALE
        ds_factor = 1.0
        if SCORE_AFFINE:  # the affine form's factors for this head
            aff_s, aff_k, aff_q, aff_c = score_mod_affine(b, h, $score_mod_params)
            qk_factor = SM_SCALE * aff_s * LOG2E
            kv_factor = aff_k * LOG2E
            ds_factor = aff_s
        n_partial, n_tiles, P_IDX, F_IDX = q_lists(
            Q_NUM_BLKS, Q_IDX, FULL_Q_NUM_BLKS, FULL_Q_IDX, b, h, kv_blk,
            stride_nz, stride_nh, stride_nn, stride_iz, stride_ih, stride_in,
            stride_fnz, stride_fnh, stride_fnn, stride_fiz, stride_fih, stride_fin, TILES_PER_BLOCK, HAS_FULL_BLOCKS)
        for step in range(n_tiles):
            slot = it % NUM_BUFFERS
            phase = (it // NUM_BUFFERS) & 1
            # DQ_ORDERED: from the last query tile, which the programs of lower KV tiles (before this one
            # in the tiles' order) reach at the same step or earlier under causal-like masks
            j = n_tiles - 1 - step if DQ_ORDERED else step
            start, _, partial = q_tile(j, n_partial, P_IDX, F_IDX, TILES_PER_BLOCK, SPARSE_Q_BLOCK_SIZE, BLOCK_M,
                                       BLOCKS_ARE_CONTIGUOUS, DQ_ORDERED)
            q = q_bufs.index(slot).reshape([BLOCK_M, HEAD_DIM])
            do = do_bufs.index(slot).reshape([BLOCK_M, HEAD_DIM])
            # -- S = Q K_w^T and dP = dO V_w^T on the tensor cores while the row statistics load
            if PERSISTENT:
                # the K and V views taken anew each step from a buffer index the compiler cannot
                # prove constant (start >= 0): views of a register-held index hoisted out of the
                # loop took registers for every product's descriptors, which spilled (27 and 43
                # local accesses per step instead of 13 and 16 at head dim 128)
                kb = kb + (start >> 31)
                k_step = k_bufs.index(kb).reshape([BLOCK_N, HEAD_DIM]).slice(WG * ROWS, ROWS, dim=0)
                v_step = v_bufs.index(kb).reshape([BLOCK_N, HEAD_DIM]).slice(WG * ROWS, ROWS, dim=0)
            else:
                k_step = k_w
                v_step = v_w
            mbarrier.wait(q_ready.index(slot), phase)
            s = warpgroup_mma(q, k_step.permute((1, 0)), zero_s, use_acc=False, is_async=True)
            mbarrier.wait(do_ready.index(slot), phase)
            dp = warpgroup_mma(do, v_step.permute((1, 0)), zero_s, use_acc=False, is_async=True)
            rows = start + gl.arange(0, BLOCK_M, layout=row_s)
            lse = gl.load(LSEh + rows * stride_lm, mask=rows < Q_LEN, other=float("inf"))
            # [Note] a fully masked row has LSE -inf: +inf makes its P exactly 0, as in backward.py
            kv_term = 0.0
            if SCORE_AFFINE:
                # positions relative to the query tile's first row r: u(kv_idx) = K (kv_idx - r), and
                # LSE - w(q_idx) with w = Q (q_idx - r) + (K + Q) r + C here (the forward's split puts
                # the last two terms in u: the same sum; a row whose C is -inf has LSE -inf, caught
                # before the subtraction). In u they measured 96 spill loads at head dim 128, 45 here
                kv_term = kv_factor * (kv_idx - start).to(gl.float32)
                row_w = aff_q * (rows - start).to(gl.float32) + ((aff_k + aff_q) * start.to(gl.float32) + aff_c)
                lse2 = gl.expand_dims(gl.where(lse == -float("inf"), float("inf"), (lse - row_w) * LOG2E), 1)
            else:
                lse2 = gl.expand_dims(gl.where(lse == -float("inf"), float("inf"), lse * LOG2E), 1)
            delta = gl.expand_dims(gl.load(DELTAh + rows, mask=rows < Q_LEN, other=0.0), 1)
            q_idx = gl.expand_dims(rows, 1)
            s = warpgroup_mma_wait(1, deps=(s, ))
            if IS_DIVISIBLE:
                masked = partial
            else:
                masked = partial | (start + BLOCK_M > Q_LEN) | kv_edge
            if LATE_DP_WAIT:
                # a score_mod whose derivative in the score is a constant (ALiBi-like): the exp2 runs
                # under dP, whose wait comes after the branch (ptxas hoists a wgmma wait to the top
                # of its basic block). The mask stays inside the branch: a bool tile live across the
                # merge is packed into registers, bit by bit (ALiBi + causal at head dim 128: 170
                # more instructions per step, 11% slower at S=8k)
                if SCORE_AFFINE:
                    t = s * qk_factor + kv_term - lse2
                else:
                    qk = (s * SM_SCALE).to(SCORE_DTYPE)
                    s = score_mod(qk, b, h, q_idx, kv_idx, $score_mod_params).to(gl.float32)
                    t = s * LOG2E - lse2
                if masked:
                    p = gl.where(tile_valid(partial, b, h, q_idx, kv_idx, Q_LEN, KV_LEN,
                                            $mask_kv_args $mask_mod_params), gl.exp2(t), 0.0)
                else:
                    p = gl.exp2(t)
                dp = warpgroup_mma_wait(0, deps=(dp, ))
                ds = p * (dp - delta)
                if SCORE_AFFINE:
                    ds = ds * ds_factor
                elif masked:  # (the mask again, not kept across the wait)
                    valid = tile_valid(partial, b, h, q_idx, kv_idx, Q_LEN, KV_LEN, $mask_kv_args $mask_mod_params)
                    ds = score_mod_dscore(qk, b, h, q_idx, kv_idx, ds, valid, $score_dscore_args).to(gl.float32)
                else:
                    ds = score_mod_dscore(qk, b, h, q_idx, kv_idx, ds, True, $score_dscore_args).to(gl.float32)
            elif masked:
                valid = tile_valid(partial, b, h, q_idx, kv_idx, Q_LEN, KV_LEN, $mask_kv_args $mask_mod_params)
                p, ds = p_and_ds(s, dp, valid, lse2, delta, b, h, q_idx, kv_idx, SM_SCALE, qk_factor, kv_term,
                                 ds_factor, $score_mod_params $mask_mod_params
                                 SCORES_IN_BASE2, SCORE_AFFINE, SCORE_DTYPE)
            else:
                p, ds = p_and_ds(s, dp, True, lse2, delta, b, h, q_idx, kv_idx, SM_SCALE, qk_factor, kv_term,
                                 ds_factor, $score_mod_params $mask_mod_params
                                 SCORES_IN_BASE2, SCORE_AFFINE, SCORE_DTYPE)
            # -- P and dS to shared memory: the A operands of dV += P^T dO and dK += dS^T Q (transposed
            # views), and dS, with the other consumer's half, of dQ = dS K
            ds_s = ds_bufs.index(it % DS_BUFFERS)
            ds_w = ds_s.slice(WG * ROWS, ROWS, dim=1)
            if DEFER_DQ:
                if it >= 2:  # both consumers' dQ products (a step later) have read the buffer taken here
                    mbarrier.wait(ds_free.index(it % 2), ((it - 2) // 2) & 1)
            p_s.store(p.to(dtype))
            ds_w.store(ds.to(dtype))
            fence_async_shared()
            _sync_warps()
            # -- dV += P^T dO; dQ = dS K (after the other consumer's dS); dK += dS^T Q runs while dQ is
            # added
            dv = warpgroup_mma(p_s.permute((1, 0)), do, dv, is_async=True)
            if COMPUTE_DQ:
                mbarrier.arrive(ds_ready.index(it % 2), count=1)
                if DEFER_DQ:
                    # the previous step's dQ (at the first step the product reads a buffer no one
                    # wrote and is not added: one branch around the add, none around the products)
                    if it > 0:  # (the other consumer's dS of the previous step)
                        mbarrier.wait(ds_ready.index((it - 1) % 2), ((it - 1) // 2) & 1)
                    dq_ds = ds_bufs.index((it + 1) % 2)
                else:  # (this step's, after the other consumer's dS)
                    mbarrier.wait(ds_ready.index(it % 2), (it // 2) & 1)
                    dq_ds = ds_s
                dq = warpgroup_mma(dq_ds, k_dq, zero_dq, use_acc=False, is_async=True)
                dk = warpgroup_mma(ds_w.permute((1, 0)), q, dk, is_async=True)
                dq, dv = warpgroup_mma_wait(1, deps=(dq, dv))
                mbarrier.arrive(do_empty.index(slot), count=1)
                if DEFER_DQ:
                    if it > 0:
                        mbarrier.arrive(ds_free.index((it - 1) % 2), count=1)
                        n_adds = dq_add(dq * SM_SCALE, dq_s, dq_smem, DQ_DESC, b, prev_h, prev_start, dq_full,
                                        dq_empty, n_adds, DQ_COL0, DQ_ORDERED)
                    prev_start = start
                    prev_h = h
                else:
                    n_adds = dq_add(dq * SM_SCALE, dq_s, dq_smem, DQ_DESC, b, h, start, dq_full, dq_empty, n_adds,
                                    DQ_COL0, DQ_ORDERED)
            else:  # (dQ in its own pass: each consumer reads only its own dS)
                dk = warpgroup_mma(ds_w.permute((1, 0)), q, dk, is_async=True)
                dv = warpgroup_mma_wait(1, deps=(dv, ))
                mbarrier.arrive(do_empty.index(slot), count=1)
            dk = warpgroup_mma_wait(0, deps=(dk, ))
            mbarrier.arrive(q_empty.index(slot), count=1)
            it += 1

    if DEFER_DQ:  # the last step's dQ
        if it > 0:
            mbarrier.wait(ds_ready.index((it - 1) % 2), ((it - 1) // 2) & 1)
            dq = warpgroup_mma(ds_bufs.index((it - 1) % 2), k_dq, zero_dq, use_acc=False, is_async=True)
            dq = warpgroup_mma_wait(0, deps=(dq, ))
            n_adds = dq_add(dq * SM_SCALE, dq_s, dq_smem, DQ_DESC, b, prev_h, prev_start, dq_full, dq_empty, n_adds,
                            DQ_COL0, DQ_ORDERED)
    if DQ_ORDERED:  # (the writer has read the last dQ: the buffer may take dK)
        if n_adds > 0:
            mbarrier.wait(dq_empty, (n_adds - 1) & 1)

    # -- dK (scaled) and dV of this consumer's rows
    if DKV_TMA and PERSISTENT:
        # staged in this consumer's rows of the V and K tiles (only its own dP and S products read
        # them); the stores complete while the next tile runs
        v_w.store(dv.to(dtype))
        k_w.store((dk * SM_SCALE).to(dtype))
        fence_async_shared()
        _sync_warps()
        _tma_store(DV, [b, h_kv, my_n, 0], v_smem.slice(WG * ROWS, ROWS, dim=2))
        _tma_store(DK, [b, h_kv, my_n, 0], k_smem.slice(WG * ROWS, ROWS, dim=2))
    elif DKV_TMA:
        # through the TMA unit (rows past KV_LEN clipped), staged in this consumer's own shared
        # memory: dV in its rows of the V tile (only its dP products read them), dK in its dQ buffer
        # (as many bytes) once the last dQ add has read that
        v_w.store(dv.to(dtype))
        tma.store_wait(0)
        dk_s = _reinterpret(dq_smem, dtype, DK.block_type.shape, DK.layout)
        dk_s.reshape([ROWS, HEAD_DIM]).store((dk * SM_SCALE).to(dtype))
        fence_async_shared()
        _sync_warps()
        _tma_store(DV, [b, h_kv, my_n, 0], v_smem.slice(WG * ROWS, ROWS, dim=2))
        _tma_store(DK, [b, h_kv, my_n, 0], dk_s)
        tma.store_wait(0)
    else:
        tma.store_wait(0)
        rows_o = gl.expand_dims(my_n + gl.arange(0, ROWS, layout=gl.SliceLayout(1, acc_layout)), 1)
        cols_o = gl.expand_dims(gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, acc_layout)), 0)
        keep = rows_o < KV_LEN
        gl.store(DK + b64 * stride_dkz + h_kv.to(gl.int64) * stride_dkh + rows_o.to(gl.int64) * stride_dkn + cols_o,
                 (dk * SM_SCALE).to(DK.dtype.element_ty), mask=keep)
        gl.store(DV + b64 * stride_dvz + h_kv.to(gl.int64) * stride_dvh + rows_o.to(gl.int64) * stride_dvn + cols_o,
                 dv.to(DV.dtype.element_ty), mask=keep)
    return it


@gluon.jit
def consumer(k_smem, v_smem, q_bufs, do_bufs, p_bufs, ds_bufs, dq_bufs, DQ_DESC, dq_full, dq_empty, kv_bar, q_ready,
             q_empty, do_ready, do_empty, ds_ready, ds_free, LSE, DELTA, DK, DV, Q_NUM_BLKS, Q_IDX, FULL_Q_NUM_BLKS,
             FULL_Q_IDX,
             $score_mod_params $mask_mod_params
             stride_lz, stride_lh, stride_lm,
             stride_dkz, stride_dkh, stride_dkn, stride_dvz, stride_dvh, stride_dvn,
             stride_nz, stride_nh, stride_nn, stride_iz, stride_ih, stride_in,
             stride_fnz, stride_fnh, stride_fnn, stride_fiz, stride_fih, stride_fin,
             b, h_kv, off_n, kv_blk, HQ, Q_LEN, KV_LEN, SM_SCALE,
             WG: gl.constexpr, GQA_SHARED_HEADS: gl.constexpr, TILES_PER_BLOCK: gl.constexpr,
             SPARSE_Q_BLOCK_SIZE: gl.constexpr, BLOCK_M: gl.constexpr, HAS_FULL_BLOCKS: gl.constexpr,
             BLOCKS_ARE_CONTIGUOUS: gl.constexpr, IS_DIVISIBLE: gl.constexpr, SCORES_IN_BASE2: gl.constexpr,
             SCORE_AFFINE: gl.constexpr, LATE_DP_WAIT: gl.constexpr, SCORE_DTYPE: gl.constexpr,
             DEFER_DQ: gl.constexpr, DKV_TMA: gl.constexpr, COMPUTE_DQ: gl.constexpr, DQ_ORDERED: gl.constexpr):
    # (the step count as a value, not a constant: it changes in the loops)
    consume_tile(k_smem, v_smem, k_smem, v_smem, 0, q_bufs, do_bufs, p_bufs, ds_bufs, dq_bufs, DQ_DESC, dq_full,
                 dq_empty, kv_bar, 0, kv_bar, False,
                 gl.program_id(0) * 0,
                 q_ready, q_empty, do_ready, do_empty, ds_ready, ds_free, LSE, DELTA, DK, DV, Q_NUM_BLKS, Q_IDX,
                 FULL_Q_NUM_BLKS, FULL_Q_IDX,
                 $score_mod_params $mask_mod_params
                 stride_lz, stride_lh, stride_lm,
                 stride_dkz, stride_dkh, stride_dkn, stride_dvz, stride_dvh, stride_dvn,
                 stride_nz, stride_nh, stride_nn, stride_iz, stride_ih, stride_in,
                 stride_fnz, stride_fnh, stride_fnn, stride_fiz, stride_fih, stride_fin,
                 b, h_kv, off_n, kv_blk, HQ, Q_LEN, KV_LEN, SM_SCALE,
                 WG, GQA_SHARED_HEADS, TILES_PER_BLOCK, SPARSE_Q_BLOCK_SIZE, BLOCK_M, HAS_FULL_BLOCKS,
                 BLOCKS_ARE_CONTIGUOUS, IS_DIVISIBLE, SCORES_IN_BASE2, SCORE_AFFINE, LATE_DP_WAIT, SCORE_DTYPE,
                 DEFER_DQ, DKV_TMA, COMPUTE_DQ, False, DQ_ORDERED)


@gluon.jit
def persistent_consumer(k_bufs, v_bufs, q_bufs, do_bufs, p_bufs, ds_bufs, dq_bufs, DQ_DESC, kv_ready, kv_empty,
                        q_ready, q_empty, do_ready, do_empty, ds_ready, ds_free, LSE, DELTA, DK, DV, Q_NUM_BLKS,
                        Q_IDX, FULL_Q_NUM_BLKS, FULL_Q_IDX,
                        $score_mod_params $mask_mod_params
                        stride_lz, stride_lh, stride_lm,
                        stride_dkz, stride_dkh, stride_dkn, stride_dvz, stride_dvh, stride_dvn,
                        stride_nz, stride_nh, stride_nn, stride_iz, stride_ih, stride_in,
                        stride_fnz, stride_fnh, stride_fnn, stride_fiz, stride_fih, stride_fin,
                        HQ, HKV, BATCH, Q_LEN, KV_LEN, HEAD_GROUP, SM_SCALE,
                        WG: gl.constexpr, GQA_SHARED_HEADS: gl.constexpr, TILES_PER_BLOCK: gl.constexpr,
                        SPARSE_Q_BLOCK_SIZE: gl.constexpr, BLOCK_M: gl.constexpr, HAS_FULL_BLOCKS: gl.constexpr,
                        BLOCKS_ARE_CONTIGUOUS: gl.constexpr, IS_DIVISIBLE: gl.constexpr, SCORES_IN_BASE2: gl.constexpr,
                        SCORE_AFFINE: gl.constexpr, LATE_DP_WAIT: gl.constexpr, SCORE_DTYPE: gl.constexpr,
                        DEFER_DQ: gl.constexpr, DKV_TMA: gl.constexpr, COMPUTE_DQ: gl.constexpr,
                        SPARSE_KV_BLOCK_SIZE: gl.constexpr):
    """`consume_tile` for this program's KV tiles in turn (`tile_order`, as the loader takes them),
    their K and V in two buffers taken in turn; the last tile's stores are waited for at the end.
    (Taking the tiles in pairs, so that each buffer's shared memory addresses are constants, put
    the step loop's code in twice and spilled 2.5 times as much per step at head dim 128.)"""
    BLOCK_N: gl.constexpr = k_bufs.type.shape[3]
    n_tiles = gl.cdiv(KV_LEN, BLOCK_N)
    it = 0
    tc = 0
    for lin in range(gl.program_id(0), n_tiles * BATCH * HKV, gl.num_programs(0)):
        pid_n, pid_bh = tile_order(lin, n_tiles, BATCH * HKV, HEAD_GROUP)
        off_n = pid_n * BLOCK_N
        kb = tc % 2
        it = consume_tile(k_bufs.index(kb), v_bufs.index(kb), k_bufs, v_bufs, kb, q_bufs, do_bufs, p_bufs, ds_bufs,
                          dq_bufs, DQ_DESC, kv_ready.index(kb), kv_ready.index(kb),  # (no DQ_ORDERED barriers)
                          kv_ready.index(kb), (tc // 2) & 1, kv_empty.index(1 - kb), tc > 0, it,
                          q_ready, q_empty, do_ready, do_empty, ds_ready, ds_free, LSE, DELTA, DK, DV, Q_NUM_BLKS,
                          Q_IDX, FULL_Q_NUM_BLKS, FULL_Q_IDX,
                          $score_mod_params $mask_mod_params
                          stride_lz, stride_lh, stride_lm,
                          stride_dkz, stride_dkh, stride_dkn, stride_dvz, stride_dvh, stride_dvn,
                          stride_nz, stride_nh, stride_nn, stride_iz, stride_ih, stride_in,
                          stride_fnz, stride_fnh, stride_fnn, stride_fiz, stride_fih, stride_fin,
                          pid_bh // HKV, pid_bh % HKV, off_n, off_n // SPARSE_KV_BLOCK_SIZE, HQ, Q_LEN, KV_LEN,
                          SM_SCALE, WG, GQA_SHARED_HEADS, TILES_PER_BLOCK, SPARSE_Q_BLOCK_SIZE, BLOCK_M,
                          HAS_FULL_BLOCKS, BLOCKS_ARE_CONTIGUOUS, IS_DIVISIBLE, SCORES_IN_BASE2, SCORE_AFFINE,
                          LATE_DP_WAIT, SCORE_DTYPE, DEFER_DQ, DKV_TMA, COMPUTE_DQ, True, False)
        tc += 1
    tma.store_wait(0)


@gluon.jit
def persistent(Q, K, V, DO, DQ_DESC, LSE, DELTA, DK, DV, Q_NUM_BLKS, Q_IDX, FULL_Q_NUM_BLKS, FULL_Q_IDX,
               $score_mod_params $mask_mod_params
               stride_lz, stride_lh, stride_lm,
               stride_dkz, stride_dkh, stride_dkn, stride_dvz, stride_dvh, stride_dvn,
               stride_nz, stride_nh, stride_nn, stride_iz, stride_ih, stride_in,
               stride_fnz, stride_fnh, stride_fnn, stride_fiz, stride_fih, stride_fin,
               HQ, HKV, BATCH, Q_LEN, KV_LEN, HEAD_GROUP, SM_SCALE,
               GQA_SHARED_HEADS: gl.constexpr, TILES_PER_BLOCK: gl.constexpr, SPARSE_Q_BLOCK_SIZE: gl.constexpr,
               SPARSE_KV_BLOCK_SIZE: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
               KV_BATCH_BROADCAST: gl.constexpr, HAS_FULL_BLOCKS: gl.constexpr, BLOCKS_ARE_CONTIGUOUS: gl.constexpr,
               IS_DIVISIBLE: gl.constexpr, SCORES_IN_BASE2: gl.constexpr, SCORE_AFFINE: gl.constexpr,
               LATE_DP_WAIT: gl.constexpr, NUM_BUFFERS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
               SCORE_DTYPE: gl.constexpr, DKV_TMA: gl.constexpr):
    """The kernel without dQ (COMPUTE_DQ off) as persistent programs, one per SM, each walking KV
    tiles (`tile_order`) with two K/V buffers: a tile's K, V and first Q and dO tiles load during
    the previous tile's last steps, and its dK and dV stores run during the next tile's first, so
    that short programs (16 documents: 4 to 16 steps) do not wait for memory at either end. Each
    consumer stages its dK and dV in its own rows of the tile's K and V buffers; no dQ buffers
    and one dS buffer (the shared memory holds the second K/V tile at head dim 128)."""
    k_bufs = gl.allocate_shared_memory(K.dtype, [2] + K.block_type.shape, K.layout)
    v_bufs = gl.allocate_shared_memory(V.dtype, [2] + V.block_type.shape, V.layout)
    q_bufs = gl.allocate_shared_memory(Q.dtype, [NUM_BUFFERS] + Q.block_type.shape, Q.layout)
    do_bufs = gl.allocate_shared_memory(DO.dtype, [NUM_BUFFERS] + DO.block_type.shape, DO.layout)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], Q.dtype)
    ds_bufs = gl.allocate_shared_memory(Q.dtype, [1, BLOCK_M, BLOCK_N], ds_layout)
    p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N // 2], Q.dtype)
    p_bufs = gl.allocate_shared_memory(Q.dtype, [2, BLOCK_M, BLOCK_N // 2], p_layout)
    kv_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    do_ready = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    do_empty = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(kv_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=2)  # one arrival per consumer
    for i in gl.static_range(NUM_BUFFERS):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=2)
        mbarrier.init(do_ready.index(i), count=1)
        mbarrier.init(do_empty.index(i), count=2)
    # (no dQ: the dS barriers and the dQ buffers are never used; p_bufs stands in for the latter)
    gl.warp_specialize([
        (persistent_consumer, (k_bufs, v_bufs, q_bufs, do_bufs, p_bufs, ds_bufs, p_bufs, DQ_DESC, kv_ready, kv_empty,
                               q_ready, q_empty, do_ready, do_empty, kv_ready, kv_empty, LSE, DELTA, DK, DV,
                               Q_NUM_BLKS, Q_IDX, FULL_Q_NUM_BLKS, FULL_Q_IDX,
                               $score_mod_params $mask_mod_params
                               stride_lz, stride_lh, stride_lm,
                               stride_dkz, stride_dkh, stride_dkn, stride_dvz, stride_dvh, stride_dvn,
                               stride_nz, stride_nh, stride_nn, stride_iz, stride_ih, stride_in,
                               stride_fnz, stride_fnh, stride_fnn, stride_fiz, stride_fih, stride_fin,
                               HQ, HKV, BATCH, Q_LEN, KV_LEN, HEAD_GROUP, SM_SCALE,
                               0, GQA_SHARED_HEADS, TILES_PER_BLOCK, SPARSE_Q_BLOCK_SIZE, BLOCK_M, HAS_FULL_BLOCKS,
                               BLOCKS_ARE_CONTIGUOUS, IS_DIVISIBLE, SCORES_IN_BASE2, SCORE_AFFINE, LATE_DP_WAIT,
                               SCORE_DTYPE, False, DKV_TMA, False, SPARSE_KV_BLOCK_SIZE)),
        (persistent_consumer, (k_bufs, v_bufs, q_bufs, do_bufs, p_bufs, ds_bufs, p_bufs, DQ_DESC, kv_ready, kv_empty,
                               q_ready, q_empty, do_ready, do_empty, kv_ready, kv_empty, LSE, DELTA, DK, DV,
                               Q_NUM_BLKS, Q_IDX, FULL_Q_NUM_BLKS, FULL_Q_IDX,
                               $score_mod_params $mask_mod_params
                               stride_lz, stride_lh, stride_lm,
                               stride_dkz, stride_dkh, stride_dkn, stride_dvz, stride_dvh, stride_dvn,
                               stride_nz, stride_nh, stride_nn, stride_iz, stride_ih, stride_in,
                               stride_fnz, stride_fnh, stride_fnn, stride_fiz, stride_fih, stride_fin,
                               HQ, HKV, BATCH, Q_LEN, KV_LEN, HEAD_GROUP, SM_SCALE,
                               1, GQA_SHARED_HEADS, TILES_PER_BLOCK, SPARSE_Q_BLOCK_SIZE, BLOCK_M, HAS_FULL_BLOCKS,
                               BLOCKS_ARE_CONTIGUOUS, IS_DIVISIBLE, SCORES_IN_BASE2, SCORE_AFFINE, LATE_DP_WAIT,
                               SCORE_DTYPE, False, DKV_TMA, False, SPARSE_KV_BLOCK_SIZE)),
        (persistent_loader, (Q, K, V, DO, k_bufs, v_bufs, q_bufs, do_bufs, kv_ready, kv_empty, q_ready, q_empty,
                             do_ready, do_empty, Q_NUM_BLKS, Q_IDX, FULL_Q_NUM_BLKS, FULL_Q_IDX,
                             stride_nz, stride_nh, stride_nn, stride_iz, stride_ih, stride_in,
                             stride_fnz, stride_fnh, stride_fnn, stride_fiz, stride_fih, stride_fin,
                             HKV, BATCH, KV_LEN, HEAD_GROUP,
                             GQA_SHARED_HEADS, TILES_PER_BLOCK, SPARSE_Q_BLOCK_SIZE, SPARSE_KV_BLOCK_SIZE, BLOCK_M,
                             HAS_FULL_BLOCKS, BLOCKS_ARE_CONTIGUOUS, KV_BATCH_BROADCAST)),
    ], [4, 1], [CONSUMER_REGS, 24])


@gluon.jit
def flex_attention_backward(
$flex_attention_backward_params
):
    gl.static_assert(SPARSE_Q_BLOCK_SIZE % BLOCK_M == 0)
    gl.static_assert(SPARSE_KV_BLOCK_SIZE % BLOCK_N == 0)
    TILES_PER_BLOCK: gl.constexpr = SPARSE_Q_BLOCK_SIZE // BLOCK_M
    KV_TILES_PER_BLOCK: gl.constexpr = SPARSE_KV_BLOCK_SIZE // BLOCK_N
    gl.static_assert(COMPUTE_DQ or not DQ_ORDERED)
    if PERSISTENT:
        gl.static_assert(not COMPUTE_DQ)
        persistent(Q, K, V, DO, DQ_DESC, LSE, DELTA, DK, DV, Q_NUM_BLKS, Q_IDX, FULL_Q_NUM_BLKS, FULL_Q_IDX,
                   $score_mod_params $mask_mod_params
                   stride_lz, stride_lh, stride_lm,
                   stride_dkz, stride_dkh, stride_dkn, stride_dvz, stride_dvh, stride_dvn,
                   stride_nz, stride_nh, stride_nn, stride_iz, stride_ih, stride_in,
                   stride_fnz, stride_fnh, stride_fnn, stride_fiz, stride_fih, stride_fin,
                   HQ, HKV, BATCH, Q_LEN, KV_LEN, HEAD_GROUP, SM_SCALE,
                   GQA_SHARED_HEADS, TILES_PER_BLOCK, SPARSE_Q_BLOCK_SIZE, SPARSE_KV_BLOCK_SIZE, BLOCK_M, BLOCK_N,
                   KV_BATCH_BROADCAST, HAS_FULL_BLOCKS, BLOCKS_ARE_CONTIGUOUS, IS_DIVISIBLE, SCORES_IN_BASE2,
                   SCORE_AFFINE, LATE_DP_WAIT, NUM_BUFFERS, CONSUMER_REGS, SCORE_DTYPE, DKV_TMA)
        return
    pid_n, pid_bh = program_tile(HEAD_GROUP)
    b = pid_bh // HKV
    h_kv = pid_bh % HKV
    b_kv = 0 if KV_BATCH_BROADCAST else b
    off_n = pid_n * BLOCK_N
    kv_blk = off_n // SPARSE_KV_BLOCK_SIZE

    k_smem = gl.allocate_shared_memory(K.dtype, K.block_type.shape, K.layout)
    v_smem = gl.allocate_shared_memory(V.dtype, V.block_type.shape, V.layout)
    q_bufs = gl.allocate_shared_memory(Q.dtype, [NUM_BUFFERS] + Q.block_type.shape, Q.layout)
    do_bufs = gl.allocate_shared_memory(DO.dtype, [NUM_BUFFERS] + DO.block_type.shape, DO.layout)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], Q.dtype)
    ds_bufs = gl.allocate_shared_memory(Q.dtype, [2, BLOCK_M, BLOCK_N], ds_layout)
    p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N // 2], Q.dtype)
    p_bufs = gl.allocate_shared_memory(Q.dtype, [2, BLOCK_M, BLOCK_N // 2], p_layout)
    dq_bufs = gl.allocate_shared_memory(DQ_DESC.dtype, [2] + DQ_DESC.block_type.shape, DQ_DESC.layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    do_ready = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    do_empty = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ds_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(NUM_BUFFERS):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=2)  # one arrival per consumer
        mbarrier.init(do_ready.index(i), count=1)
        mbarrier.init(do_empty.index(i), count=2)
    for i in gl.static_range(2):
        mbarrier.init(ds_ready.index(i), count=2)
        mbarrier.init(ds_free.index(i), count=2)

    # (the same partitions twice, DQ_ORDERED's with the writer: Gluon takes no tuple of arguments
    # built beforehand)
    if DQ_ORDERED:
        # both consumers' halves of a dQ tile stored (dq_full), the writer has read them (dq_empty)
        dq_full = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        dq_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(dq_full, count=2)
        mbarrier.init(dq_empty, count=1)
        gl.warp_specialize([
            (consumer, (k_smem, v_smem, q_bufs, do_bufs, p_bufs, ds_bufs, dq_bufs, DQ_DESC, dq_full, dq_empty, kv_bar,
                        q_ready, q_empty, do_ready, do_empty, ds_ready, ds_free, LSE, DELTA, DK, DV, Q_NUM_BLKS, Q_IDX,
                        FULL_Q_NUM_BLKS, FULL_Q_IDX,
                        $score_mod_params $mask_mod_params
                        stride_lz, stride_lh, stride_lm,
                        stride_dkz, stride_dkh, stride_dkn, stride_dvz, stride_dvh, stride_dvn,
                        stride_nz, stride_nh, stride_nn, stride_iz, stride_ih, stride_in,
                        stride_fnz, stride_fnh, stride_fnn, stride_fiz, stride_fih, stride_fin,
                        b, h_kv, off_n, kv_blk, HQ, Q_LEN, KV_LEN, SM_SCALE,
                        0, GQA_SHARED_HEADS, TILES_PER_BLOCK, SPARSE_Q_BLOCK_SIZE, BLOCK_M, HAS_FULL_BLOCKS,
                        BLOCKS_ARE_CONTIGUOUS, IS_DIVISIBLE, SCORES_IN_BASE2, SCORE_AFFINE, LATE_DP_WAIT, SCORE_DTYPE,
                        DEFER_DQ, DKV_TMA, COMPUTE_DQ, DQ_ORDERED)),
            (consumer, (k_smem, v_smem, q_bufs, do_bufs, p_bufs, ds_bufs, dq_bufs, DQ_DESC, dq_full, dq_empty, kv_bar,
                        q_ready, q_empty, do_ready, do_empty, ds_ready, ds_free, LSE, DELTA, DK, DV, Q_NUM_BLKS, Q_IDX,
                        FULL_Q_NUM_BLKS, FULL_Q_IDX,
                        $score_mod_params $mask_mod_params
                        stride_lz, stride_lh, stride_lm,
                        stride_dkz, stride_dkh, stride_dkn, stride_dvz, stride_dvh, stride_dvn,
                        stride_nz, stride_nh, stride_nn, stride_iz, stride_ih, stride_in,
                        stride_fnz, stride_fnh, stride_fnn, stride_fiz, stride_fih, stride_fin,
                        b, h_kv, off_n, kv_blk, HQ, Q_LEN, KV_LEN, SM_SCALE,
                        1, GQA_SHARED_HEADS, TILES_PER_BLOCK, SPARSE_Q_BLOCK_SIZE, BLOCK_M, HAS_FULL_BLOCKS,
                        BLOCKS_ARE_CONTIGUOUS, IS_DIVISIBLE, SCORES_IN_BASE2, SCORE_AFFINE, LATE_DP_WAIT, SCORE_DTYPE,
                        DEFER_DQ, DKV_TMA, COMPUTE_DQ, DQ_ORDERED)),
            (loader, (Q, K, V, DO, k_smem, v_smem, q_bufs, do_bufs, kv_bar, q_ready, q_empty, do_ready, do_empty,
                      Q_NUM_BLKS, Q_IDX, FULL_Q_NUM_BLKS, FULL_Q_IDX,
                      stride_nz, stride_nh, stride_nn, stride_iz, stride_ih, stride_in,
                      stride_fnz, stride_fnh, stride_fnn, stride_fiz, stride_fih, stride_fin,
                      b, b_kv, h_kv, off_n, kv_blk,
                      GQA_SHARED_HEADS, TILES_PER_BLOCK, SPARSE_Q_BLOCK_SIZE, BLOCK_M, HAS_FULL_BLOCKS,
                      BLOCKS_ARE_CONTIGUOUS, DQ_ORDERED)),
            (dq_writer, (DQ_DESC, dq_bufs, dq_full, dq_empty, DQ_SEM, Q_NUM_BLKS, Q_IDX, FULL_Q_NUM_BLKS,
                         FULL_Q_IDX,
                         stride_nz, stride_nh, stride_nn, stride_iz, stride_ih, stride_in,
                         stride_fnz, stride_fnh, stride_fnn, stride_fiz, stride_fih, stride_fin,
                         b, h_kv, kv_blk, pid_n % KV_TILES_PER_BLOCK, HQ, Q_LEN,
                         GQA_SHARED_HEADS, TILES_PER_BLOCK, KV_TILES_PER_BLOCK, SPARSE_Q_BLOCK_SIZE, BLOCK_M,
                         HAS_FULL_BLOCKS, BLOCKS_ARE_CONTIGUOUS)),
        ], [4, 1, 1], [CONSUMER_REGS, 24, 24])
    else:  # (kv_bar stands in for the barriers the consumers only use with DQ_ORDERED)
        gl.warp_specialize([
            (consumer, (k_smem, v_smem, q_bufs, do_bufs, p_bufs, ds_bufs, dq_bufs, DQ_DESC, kv_bar, kv_bar, kv_bar,
                        q_ready, q_empty, do_ready, do_empty, ds_ready, ds_free, LSE, DELTA, DK, DV, Q_NUM_BLKS, Q_IDX,
                        FULL_Q_NUM_BLKS, FULL_Q_IDX,
                        $score_mod_params $mask_mod_params
                        stride_lz, stride_lh, stride_lm,
                        stride_dkz, stride_dkh, stride_dkn, stride_dvz, stride_dvh, stride_dvn,
                        stride_nz, stride_nh, stride_nn, stride_iz, stride_ih, stride_in,
                        stride_fnz, stride_fnh, stride_fnn, stride_fiz, stride_fih, stride_fin,
                        b, h_kv, off_n, kv_blk, HQ, Q_LEN, KV_LEN, SM_SCALE,
                        0, GQA_SHARED_HEADS, TILES_PER_BLOCK, SPARSE_Q_BLOCK_SIZE, BLOCK_M, HAS_FULL_BLOCKS,
                        BLOCKS_ARE_CONTIGUOUS, IS_DIVISIBLE, SCORES_IN_BASE2, SCORE_AFFINE, LATE_DP_WAIT, SCORE_DTYPE,
                        DEFER_DQ, DKV_TMA, COMPUTE_DQ, DQ_ORDERED)),
            (consumer, (k_smem, v_smem, q_bufs, do_bufs, p_bufs, ds_bufs, dq_bufs, DQ_DESC, kv_bar, kv_bar, kv_bar,
                        q_ready, q_empty, do_ready, do_empty, ds_ready, ds_free, LSE, DELTA, DK, DV, Q_NUM_BLKS, Q_IDX,
                        FULL_Q_NUM_BLKS, FULL_Q_IDX,
                        $score_mod_params $mask_mod_params
                        stride_lz, stride_lh, stride_lm,
                        stride_dkz, stride_dkh, stride_dkn, stride_dvz, stride_dvh, stride_dvn,
                        stride_nz, stride_nh, stride_nn, stride_iz, stride_ih, stride_in,
                        stride_fnz, stride_fnh, stride_fnn, stride_fiz, stride_fih, stride_fin,
                        b, h_kv, off_n, kv_blk, HQ, Q_LEN, KV_LEN, SM_SCALE,
                        1, GQA_SHARED_HEADS, TILES_PER_BLOCK, SPARSE_Q_BLOCK_SIZE, BLOCK_M, HAS_FULL_BLOCKS,
                        BLOCKS_ARE_CONTIGUOUS, IS_DIVISIBLE, SCORES_IN_BASE2, SCORE_AFFINE, LATE_DP_WAIT, SCORE_DTYPE,
                        DEFER_DQ, DKV_TMA, COMPUTE_DQ, DQ_ORDERED)),
            (loader, (Q, K, V, DO, k_smem, v_smem, q_bufs, do_bufs, kv_bar, q_ready, q_empty, do_ready, do_empty,
                      Q_NUM_BLKS, Q_IDX, FULL_Q_NUM_BLKS, FULL_Q_IDX,
                      stride_nz, stride_nh, stride_nn, stride_iz, stride_ih, stride_in,
                      stride_fnz, stride_fnh, stride_fnn, stride_fiz, stride_fih, stride_fin,
                      b, b_kv, h_kv, off_n, kv_blk,
                      GQA_SHARED_HEADS, TILES_PER_BLOCK, SPARSE_Q_BLOCK_SIZE, BLOCK_M, HAS_FULL_BLOCKS,
                      BLOCKS_ARE_CONTIGUOUS, DQ_ORDERED)),
        ], [4, 1], [CONSUMER_REGS, 24])
