# Split-KV decoding forward: a few query rows against a long KV cache, in one launch.
#
# One program owns one KV head of one batch element, one tile of packed query rows and one of
# SPLIT_KV slices of the KV tiles. Every query head that shares the KV head (GQA) is packed into
# the same row tile, so each K/V tile is read from memory once for all of them and multiplied with
# one tl.dot. With SPLIT_KV == 1 the program normalises and writes Out and LSE itself. Otherwise
# each program stores its unnormalised partial (acc, m, l) and counts itself in on its row tile's
# counter (SPLITS_DONE); the program that completes the count, the row tile's last, merges the
# SPLIT_KV partials with a log-sum-exp reduction, writes Out and LSE, and takes the count back to
# zero, so the counters are zero again when the kernel ends (no memset per call).
# LSE and the partials share one float32 scratch buffer (one allocation per call): LSE's N_ROWS
# values first, then M_part and L_part [SPLIT_KV, N_ROWS] and Acc_part [SPLIT_KV, N_ROWS, V_HEAD_DIM].
#
# Names follow the forward template (forward.py); what only decoding has is marked (decode). The
# tile helpers (load_tile, mma, online_softmax, add_sink) are tiles.py's (the tile_helpers hook).
#
# sub notation:
#   Q               [B, HQ, Q_LEN, QK_HEAD_DIM]
#   K, V            [B or 1, HKV, KV_LEN, QK_HEAD_DIM / V_HEAD_DIM]   (batch 1: the host passes stride 0)
#   Out             [B, HQ, Q_LEN, V_HEAD_DIM]           (any strides)
#   LSE             float32 scratch: LSE [B, HQ, Q_LEN] (natural log, -inf for rows that see
#                   nothing: SINKS[h] with HAS_SINKS), then the partials (see above)
#   SPLITS_DONE     (decode) int32 [row tiles], zero between calls: how many of a row tile's splits
#                   have stored their partial (read when SPLIT_KV > 1); row tile = pid_bh * (grid
#                   axis 2) + pid_r, the programs of one row tile differing only in `split`
#   KV_NUM_BLKS, KV_IDX, FULL_KV_NUM_BLKS, FULL_KV_IDX   the BlockMask's lists, as in the forward
#   KV_LENGTHS      [B] (decode) per-batch valid KV length, read when HAS_KV_LENGTHS
#   SINKS           [HQ] per query head, read when HAS_SINKS: exp(SINKS[h]) joins each row's softmax
#                   sum with no value row (forward.py); added once, where the rows are written
#   QK_HEAD_DIM, V_HEAD_DIM   real head dims (runtime ints here, constexprs in the forward)
#   N_ROWS          (decode) B * HQ * Q_LEN: rows of LSE, and of each split's partials
#   SM_SCALE        runtime float: softmax scale applied to q.k before score_mod
#
# constexprs:
#   HKV                 KV heads
#   GQA_SHARED_HEADS    query heads per KV head (HQ // HKV); query head h reads KV head
#                       h // GQA_SHARED_HEADS, as in the forward
#   PACKED_HEADS        (decode) query heads packed into one row tile: GQA_SHARED_HEADS when every
#                       head sees the same BlockMask row (mask H == 1 or no mask), else 1 (per-head masks)
#   Q_ROWS              (decode) query rows per row group: min(Q_LEN, SPARSE_Q_BLOCK_SIZE); one row
#                       group is (a set of PACKED_HEADS heads) x (one query block of the BlockMask)
#   NUM_Q_BLOCKS        (decode) query blocks of the BlockMask that Q_LEN spans (1 in ordinary decoding)
#   M_TILES             (decode) row tiles per row group: cdiv(PACKED_HEADS * Q_ROWS, BLOCK_M)
#   BLOCK_M             packed rows per tile (>= 16 so tl.dot can run); row r is head r % PACKED_HEADS,
#                       query row r // PACKED_HEADS of the group
#   BLOCK_N             KV positions per inner step (one tl.dot)
#   QK_HEAD_DIM_ROUNDED, V_HEAD_DIM_ROUNDED  next powers of two (>= 16): tl.arange/tl.dot shapes
#   SPLIT_KV            (decode) programs that share one row tile's KV range; each takes a contiguous
#                       slice of its tile list (the sparse block list, or all tiles when dense)
#   TILE_KV             (decode) KV positions one dense tile-list entry covers (== BLOCK_N)
#   SPARSE_Q_BLOCK_SIZE, SPARSE_KV_BLOCK_SIZE  the BlockMask's block sizes (a multiple of BLOCK_N)
#   HAS_BLOCK_MASK      (decode) walk KV_IDX / FULL_KV_IDX; otherwise all of [0, KV_LEN) is visited
#   HAS_FULL_BLOCKS     the BlockMask has full_kv_* lists (tiles where the mask is all true)
#   APPLY_MASK_DENSE    (decode) run mask_mod on every tile of the dense walk (mask_mod without BlockMask)
#   HAS_KV_LENGTHS      (decode) a per-batch valid length caps the KV range (KV_LENGTHS[b], read
#                       in-kernel; positions past it are masked loads, so they cost no memory traffic)
#   HAS_SINKS           fold SINKS into the rows' max and sum before they are written (add_sink)
#   IS_DIVISIBLE_M      the row half of the forward's IS_DIVISIBLE: every packed row of every tile
#                       is a real (head, query) row, so no row masks
#   IS_DIVISIBLE_N      the KV half: KV_LEN is a multiple of the walked tile and there are no
#                       per-batch lengths, so no KV masks on loads and scores
#   SAFE_HEAD_DIM       both head dims are already their rounded sizes: no column masks
#   DOT_PRECISION       tl.dot input_precision ("ieee" for float32 inputs, "tf32" if asked)
#   DOT_IN_FP64         (Triton's interpreter) feed tl.dot float64 copies of the tiles (see
#                       tiles.mma); P is still rounded to V's dtype first
#   MERGE_M             (decode) rows the merging program handles: every real row of a row tile
#                       (a power of two <= BLOCK_M; fewer than BLOCK_M when the tile is padded)
#   MERGE_CHUNK         (decode) partials the merge reads per step: a [MERGE_M, MERGE_CHUNK,
#                       V_HEAD_DIM_ROUNDED] tile (a power of two)
$prelude

$score_mod_def

$mask_mod_def


$tile_helpers


@triton.jit
def decode_tile(
    acc, l_i, m_i, q, K, V, start_n, b, h, q_idx, kv_len, SM_SCALE,
    stride_kn, stride_kk, stride_vn, stride_vk,
    $score_params$mask_params
    QK_HEAD_DIM, V_HEAD_DIM, APPLY_MASK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    QK_HEAD_DIM_ROUNDED: tl.constexpr, V_HEAD_DIM_ROUNDED: tl.constexpr, SAFE_HEAD_DIM: tl.constexpr,
    IS_DIVISIBLE_N: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_IN_FP64: tl.constexpr,
):
    # One BLOCK_N step of the walk. K/V tile pointers advance in int64 (start_n * stride can pass
    # 2**31 on long caches); offsets inside the tile (offs_t) stay int32.
    offs_t = tl.arange(0, BLOCK_N)
    offs_n = start_n + offs_t
    offs_k = tl.arange(0, QK_HEAD_DIM_ROUNDED)
    offs_v = tl.arange(0, V_HEAD_DIM_ROUNDED)
    K_tile = K + start_n.to(tl.int64) * stride_kn
    V_tile = V + start_n.to(tl.int64) * stride_vn
    kv_idx = offs_n[None, :]
    # -- K^T [QK_HEAD_DIM_ROUNDED, BLOCK_N] (loaded transposed) and V [BLOCK_N, V_HEAD_DIM_ROUNDED]
    kT = load_tile(K_tile + offs_t[None, :] * stride_kn + offs_k[:, None] * stride_kk, offs_k, offs_n,
                   QK_HEAD_DIM, kv_len, not SAFE_HEAD_DIM, not IS_DIVISIBLE_N)
    v = load_tile(V_tile + offs_t[:, None] * stride_vn + offs_v[None, :] * stride_vk, offs_n, offs_v,
                  kv_len, V_HEAD_DIM, not IS_DIVISIBLE_N, not SAFE_HEAD_DIM)
    # -- scores, score_mod, mask_mod (flex_attention's order: mods see the scaled score)
    score = mma(q, kT, tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32), DOT_PRECISION, DOT_IN_FP64) * SM_SCALE
    score = ($score_call).to(tl.float32)
    if APPLY_MASK:
        keep = $mask_call
        if not IS_DIVISIBLE_N:
            keep = keep & (kv_idx < kv_len)
        score = tl.where(keep, score, float("-inf"))
    elif not IS_DIVISIBLE_N:
        score = tl.where(kv_idx < kv_len, score, float("-inf"))
    # -- online softmax in base 2 (rows that have seen only -inf keep l_i = 0, never NaN)
    p, alpha, l_i, m_i = online_softmax(score, m_i, l_i, False)
    # P is rounded to V's storage dtype, as the tensor-core product needs (also under DOT_IN_FP64).
    pv = mma(p.to(v.dtype), v, tl.full([BLOCK_M, V_HEAD_DIM_ROUNDED], 0.0, tl.float32), DOT_PRECISION, DOT_IN_FP64)
    acc = acc * alpha[:, None] + pv
    return acc, l_i, m_i


@triton.jit
def decode_inner(
    acc, l_i, m_i, q, K, V, b, h, q_idx, kv_len, SM_SCALE,
    TILE_LIST, split, num_tiles,
    stride_kn, stride_kk, stride_vn, stride_vk,
    $score_params$mask_params
    QK_HEAD_DIM, V_HEAD_DIM,
    IS_DENSE: tl.constexpr, APPLY_MASK: tl.constexpr, TILE: tl.constexpr, SPLIT_KV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    QK_HEAD_DIM_ROUNDED: tl.constexpr, V_HEAD_DIM_ROUNDED: tl.constexpr, SAFE_HEAD_DIM: tl.constexpr,
    IS_DIVISIBLE_N: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_IN_FP64: tl.constexpr,
):
    # This program's slice of the tile list: entries [lo, hi) of num_tiles, split evenly (cdiv
    # spelled out: the interpreter cannot call tl.cdiv from here).
    per_split = (num_tiles + SPLIT_KV - 1) // SPLIT_KV
    lo = split * per_split
    hi = tl.minimum(lo + per_split, num_tiles)
    # One flat loop over BLOCK_N steps, STEPS per entry: the software pipeliner then keeps
    # num_stages copies of one step's K and V tiles, however large the blocks (an inner loop
    # unrolled over a block's steps had all of them in flight: at head dim 256 and 256-position
    # blocks, 520 KB of shared memory).
    STEPS: tl.constexpr = TILE // BLOCK_N
    for t in range(lo * STEPS, hi * STEPS):
        if IS_DENSE:
            tile = t // STEPS
        else:
            tile = tl.load(TILE_LIST + t // STEPS)
        start_n = tile * TILE + (t % STEPS) * BLOCK_N
        # Positions past kv_len (per-batch lengths) are masked loads: they cost no K/V reads.
        acc, l_i, m_i = decode_tile(
            acc, l_i, m_i, q, K, V, start_n, b, h, q_idx, kv_len, SM_SCALE,
            stride_kn, stride_kk, stride_vn, stride_vk,
            $score_params$mask_params
            QK_HEAD_DIM, V_HEAD_DIM, APPLY_MASK, BLOCK_M, BLOCK_N,
            QK_HEAD_DIM_ROUNDED, V_HEAD_DIM_ROUNDED, SAFE_HEAD_DIM,
            IS_DIVISIBLE_N, DOT_PRECISION, DOT_IN_FP64,
        )
    return acc, l_i, m_i


@triton.jit
def packed_rows(offs_r, b, h_kv, head_group, q_block, Q_LEN, HKV: tl.constexpr, GQA_SHARED_HEADS: tl.constexpr,
                PACKED_HEADS: tl.constexpr, Q_ROWS: tl.constexpr, SPARSE_Q_BLOCK_SIZE: tl.constexpr):
    # Packed row r of a row group is head r % PACKED_HEADS, query row r // PACKED_HEADS; row_ok:
    # it is a real (head, query) row (real rows are a prefix of every row tile); row: its index in
    # the [B, HQ, Q_LEN] row space of LSE and the partials.
    h_row = h_kv * GQA_SHARED_HEADS + head_group * PACKED_HEADS + offs_r % PACKED_HEADS
    q_row = q_block * SPARSE_Q_BLOCK_SIZE + offs_r // PACKED_HEADS
    row_ok = (offs_r < PACKED_HEADS * Q_ROWS) & (q_row < Q_LEN)
    row = (b * (HKV * GQA_SHARED_HEADS) + h_row) * Q_LEN + q_row
    return h_row, q_row, row_ok, row


@triton.jit
def store_rows(
    Out, LSE, SINKS, acc, l_i, m_i, b, h_row, q_row, row, row_ok, offs_v,
    stride_oz, stride_oh, stride_om, stride_ok, V_HEAD_DIM, HAS_SINKS: tl.constexpr, CHECK: tl.constexpr,
):
    # Normalise and write Out and LSE (natural log), the rows' sink folded in first (once, after
    # the merge). [Note] a fully masked row without a sink has l_i == 0 and acc == 0: it writes 0
    # and LSE = -inf, never NaN.
    if HAS_SINKS:
        sink = tl.load(SINKS + h_row, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
        m_i, l_i, alpha = add_sink(m_i, l_i, sink)
        acc = acc * alpha[:, None]
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(l_i == 0.0, float("-inf"), (m_i + tl.log2(l_safe)) * 0.6931471805599453)
    O_ptrs = Out + b.to(tl.int64) * stride_oz + h_row[:, None] * stride_oh + q_row[:, None] * stride_om \
        + offs_v[None, :] * stride_ok
    if CHECK:
        tl.store(O_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None] & (offs_v[None, :] < V_HEAD_DIM))
    else:
        tl.store(O_ptrs, out.to(Out.dtype.element_ty))
    tl.store(LSE + row, lse, mask=row_ok)


@triton.jit
def merge_partials(
    M_part, L_part, Acc_part, row, row_ok, N_ROWS, V_HEAD_DIM,
    SPLIT_KV: tl.constexpr, MERGE_M: tl.constexpr, MERGE_CHUNK: tl.constexpr, V_HEAD_DIM_ROUNDED: tl.constexpr,
):
    # The log-sum-exp merge of the rows' SPLIT_KV partials (m in base-2 units, as online_softmax
    # keeps it): with M = max_s m_s, out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s. Read
    # MERGE_CHUNK partials at a time, rescaling what is summed so far when M grows (one chunk:
    # exactly that formula). Splits that saw nothing have m = -inf and weigh 0; loads are .cg
    # (see the ordering note in decode_split_kernel).
    offs_v = tl.arange(0, V_HEAD_DIM_ROUNDED)
    acc = tl.full([MERGE_M, V_HEAD_DIM_ROUNDED], 0.0, dtype=tl.float32)
    l_i = tl.full([MERGE_M], 0.0, dtype=tl.float32)
    m_i = tl.full([MERGE_M], float("-inf"), dtype=tl.float32)
    for s0 in range(0, SPLIT_KV, MERGE_CHUNK):
        offs_s = s0 + tl.arange(0, MERGE_CHUNK)
        part = offs_s[None, :].to(tl.int64) * N_ROWS + row[:, None]          # [MERGE_M, MERGE_CHUNK]
        ok = row_ok[:, None] & (offs_s[None, :] < SPLIT_KV)
        m_s = tl.load(M_part + part, mask=ok, other=float("-inf"), cache_modifier=".cg")
        l_s = tl.load(L_part + part, mask=ok, other=0.0, cache_modifier=".cg")
        acc_s = tl.load(Acc_part + part[:, :, None] * V_HEAD_DIM + offs_v[None, None, :],
                        mask=ok[:, :, None] & (offs_v[None, None, :] < V_HEAD_DIM), other=0.0,
                        cache_modifier=".cg")
        m_new = tl.maximum(m_i, row_max(m_s))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no partial yet: weights 0
        alpha = tl.exp2(m_i - m_ref)
        w = tl.exp2(m_s - m_ref[:, None])
        l_i = l_i * alpha + row_sum(w * l_s)
        acc = acc * alpha[:, None] + row_sum(w[:, :, None] * acc_s)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def merge_rows(
    Out, LSE, SINKS, M_part, L_part, Acc_part, b, h_kv, head_group, q_block, m_tile,
    stride_oz, stride_oh, stride_om, stride_ok, Q_LEN, V_HEAD_DIM, N_ROWS,
    HKV: tl.constexpr, GQA_SHARED_HEADS: tl.constexpr, PACKED_HEADS: tl.constexpr, Q_ROWS: tl.constexpr,
    SPARSE_Q_BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, V_HEAD_DIM_ROUNDED: tl.constexpr,
    SPLIT_KV: tl.constexpr, MERGE_M: tl.constexpr, MERGE_CHUNK: tl.constexpr, HAS_SINKS: tl.constexpr,
    CHECK: tl.constexpr,
):
    # The last split's epilogue: merge the real rows of row tile m_tile (the first MERGE_M of its
    # BLOCK_M) and write them.
    offs_r = m_tile * BLOCK_M + tl.arange(0, MERGE_M)
    h_row, q_row, row_ok, row = packed_rows(offs_r, b, h_kv, head_group, q_block, Q_LEN, HKV, GQA_SHARED_HEADS,
                                            PACKED_HEADS, Q_ROWS, SPARSE_Q_BLOCK_SIZE)
    acc, l_i, m_i = merge_partials(M_part, L_part, Acc_part, row, row_ok, N_ROWS, V_HEAD_DIM,
                                   SPLIT_KV, MERGE_M, MERGE_CHUNK, V_HEAD_DIM_ROUNDED)
    store_rows(Out, LSE, SINKS, acc, l_i, m_i, b, h_row, q_row, row, row_ok, tl.arange(0, V_HEAD_DIM_ROUNDED),
               stride_oz, stride_oh, stride_om, stride_ok, V_HEAD_DIM, HAS_SINKS, CHECK)


@triton.jit
def decode_split_kernel(
$decode_split_kernel_params
):
    tl.static_assert(BLOCK_M >= 16 and BLOCK_N >= 16)
    tl.static_assert(SPARSE_KV_BLOCK_SIZE % BLOCK_N == 0)
    tl.static_assert(MERGE_M <= BLOCK_M)
    split = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_r = tl.program_id(2)
    b = pid_bh // HKV
    h_kv = pid_bh % HKV
    # -- which row group (heads x query block) and which row tile of it
    group = pid_r // M_TILES
    m_tile = pid_r % M_TILES
    head_group = group // NUM_Q_BLOCKS
    q_block = group % NUM_Q_BLOCKS
    offs_r = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    h_row, q_row, row_ok, row = packed_rows(offs_r, b, h_kv, head_group, q_block, Q_LEN, HKV, GQA_SHARED_HEADS,
                                            PACKED_HEADS, Q_ROWS, SPARSE_Q_BLOCK_SIZE)
    # mods see h and q_idx as [BLOCK_M, 1] tiles (packed rows differ in head), kv_idx as [1, BLOCK_N]
    h = h_row[:, None]
    q_idx = q_row[:, None]

    offs_k = tl.arange(0, QK_HEAD_DIM_ROUNDED)
    offs_v = tl.arange(0, V_HEAD_DIM_ROUNDED)
    # (not load_tile: the packed rows' mask is row_ok, which the LSE / partial stores reuse)
    Q_rows = Q + b.to(tl.int64) * stride_qz + h * stride_qh + q_idx * stride_qm
    if IS_DIVISIBLE_M and SAFE_HEAD_DIM:
        q = tl.load(Q_rows + offs_k[None, :] * stride_qk)
    else:
        q = tl.load(Q_rows + offs_k[None, :] * stride_qk,
                    mask=row_ok[:, None] & (offs_k[None, :] < QK_HEAD_DIM), other=0.0)
    K_head = K + b.to(tl.int64) * stride_kz + h_kv.to(tl.int64) * stride_kh
    V_head = V + b.to(tl.int64) * stride_vz + h_kv.to(tl.int64) * stride_vh

    kv_len = KV_LEN
    if HAS_KV_LENGTHS:
        kv_len = tl.minimum(tl.load(KV_LENGTHS + b).to(tl.int32), KV_LEN)

    acc = tl.full([BLOCK_M, V_HEAD_DIM_ROUNDED], 0.0, dtype=tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)

    if HAS_BLOCK_MASK:
        # All packed heads read mask row (b, first head of the group, q_block): with
        # PACKED_HEADS > 1 the mask has H == 1 (stride 0), otherwise the group is one head.
        h_mask = h_kv * GQA_SHARED_HEADS + head_group * PACKED_HEADS
        nb = b * stride_nz + h_mask * stride_nh + q_block * stride_nm
        ib = b.to(tl.int64) * stride_iz + h_mask * stride_ih + q_block * stride_im
        # -- partial tiles: score_mod and mask_mod
        acc, l_i, m_i = decode_inner(
            acc, l_i, m_i, q, K_head, V_head, b, h, q_idx, kv_len, SM_SCALE,
            KV_IDX + ib, split, tl.load(KV_NUM_BLKS + nb),
            stride_kn, stride_kk, stride_vn, stride_vk,
            $score_params$mask_params
            QK_HEAD_DIM, V_HEAD_DIM, False, True, SPARSE_KV_BLOCK_SIZE, SPLIT_KV, BLOCK_M, BLOCK_N,
            QK_HEAD_DIM_ROUNDED, V_HEAD_DIM_ROUNDED, SAFE_HEAD_DIM, IS_DIVISIBLE_N, DOT_PRECISION, DOT_IN_FP64,
        )
        # -- full tiles: score_mod only
        if HAS_FULL_BLOCKS:
            fnb = b * stride_fnz + h_mask * stride_fnh + q_block * stride_fnm
            fib = b.to(tl.int64) * stride_fiz + h_mask * stride_fih + q_block * stride_fim
            acc, l_i, m_i = decode_inner(
                acc, l_i, m_i, q, K_head, V_head, b, h, q_idx, kv_len, SM_SCALE,
                FULL_KV_IDX + fib, split, tl.load(FULL_KV_NUM_BLKS + fnb),
                stride_kn, stride_kk, stride_vn, stride_vk,
                $score_params$mask_params
                QK_HEAD_DIM, V_HEAD_DIM, False, False, SPARSE_KV_BLOCK_SIZE, SPLIT_KV, BLOCK_M, BLOCK_N,
                QK_HEAD_DIM_ROUNDED, V_HEAD_DIM_ROUNDED, SAFE_HEAD_DIM, IS_DIVISIBLE_N, DOT_PRECISION, DOT_IN_FP64,
            )
    else:
        acc, l_i, m_i = decode_inner(
            acc, l_i, m_i, q, K_head, V_head, b, h, q_idx, kv_len, SM_SCALE,
            KV_IDX, split, (kv_len + TILE_KV - 1) // TILE_KV,
            stride_kn, stride_kk, stride_vn, stride_vk,
            $score_params$mask_params
            QK_HEAD_DIM, V_HEAD_DIM, True, APPLY_MASK_DENSE, TILE_KV, SPLIT_KV, BLOCK_M, BLOCK_N,
            QK_HEAD_DIM_ROUNDED, V_HEAD_DIM_ROUNDED, SAFE_HEAD_DIM, IS_DIVISIBLE_N, DOT_PRECISION, DOT_IN_FP64,
        )

    CHECK_OUT: tl.constexpr = not (IS_DIVISIBLE_M and SAFE_HEAD_DIM)
    if SPLIT_KV == 1:
        # -- one split: normalise here, nothing to merge
        store_rows(Out, LSE, SINKS, acc, l_i, m_i, b, h_row, q_row, row, row_ok, offs_v,
                   stride_oz, stride_oh, stride_om, stride_ok, V_HEAD_DIM, HAS_SINKS, CHECK_OUT)
    else:
        # -- this split's partial: M_part / L_part [SPLIT_KV, N_ROWS], Acc_part [SPLIT_KV, N_ROWS, V_HEAD_DIM]
        M_part = LSE + N_ROWS
        L_part = M_part + SPLIT_KV * N_ROWS
        Acc_part = L_part + SPLIT_KV * N_ROWS
        part = split.to(tl.int64) * N_ROWS + row
        tl.store(M_part + part, m_i, mask=row_ok)
        tl.store(L_part + part, l_i, mask=row_ok)
        tl.store(Acc_part + part[:, None] * V_HEAD_DIM + offs_v[None, :], acc,
                 mask=row_ok[:, None] & (offs_v[None, :] < V_HEAD_DIM))
        # -- count this split in; the row tile's last split merges. [Note] ordering: the barrier
        # puts every thread's partial stores before the counter's release (acq_rel at gpu scope is
        # cumulative over what the block stored); the last split's acquire sees every other split's
        # release, and its loads go to L2 (.cg), past an L1 that may hold stale lines.
        tl.debug_barrier()
        counter = SPLITS_DONE + pid_bh * ((GQA_SHARED_HEADS // PACKED_HEADS) * NUM_Q_BLOCKS * M_TILES) + pid_r
        done = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        # Last = the count completes a multiple of SPLIT_KV; the merge then takes SPLIT_KV off
        # rather than storing 0: should two launches ever share the counters at once (a misuse, see
        # flexattn.kernels.scratch.Counters), their rows may be wrong but the count still ends at 0.
        if done % SPLIT_KV == SPLIT_KV - 1:
            merge_rows(Out, LSE, SINKS, M_part, L_part, Acc_part, b, h_kv, head_group, q_block, m_tile,
                       stride_oz, stride_oh, stride_om, stride_ok, Q_LEN, V_HEAD_DIM, N_ROWS,
                       HKV, GQA_SHARED_HEADS, PACKED_HEADS, Q_ROWS, SPARSE_Q_BLOCK_SIZE, BLOCK_M,
                       V_HEAD_DIM_ROUNDED, SPLIT_KV, MERGE_M, MERGE_CHUNK, HAS_SINKS, CHECK_OUT)
            tl.atomic_add(counter, -SPLIT_KV, sem="relaxed", scope="gpu")
