# Block-mask construction: classify every (query tile, KV tile) of a mask_mod as empty, partial or
# full without ever materialising the [B, H, Q_LEN, KV_LEN] boolean mask, then write torch's
# BlockMask index layout straight from the classification.
#
# Three kernels share one 2-bit-per-tile state array, STATE[BH, N_Q_TILES, N_WORDS] (int32, 16
# tiles per word, tile j of a row in bits 2*(j%16)..2*(j%16)+1 of word j//16):
#   classify_kernel  grid (N_Q_TILES, BH): interval analysis decides tiles wholesale; the tiles it
#                    cannot decide are evaluated element by element with the emitted mask_mod,
#                    or, where a chunk of a row holds DEFER_MIN of them or more, listed in Deferred
#                    for exact_kernel (a row that interval analysis cannot decide, such as a query
#                    tile across two distant runs of positions, would otherwise be one program
#                    evaluating hundreds of tiles while the others wait).
#   exact_kernel     grid (NPROG,): evaluates the listed tiles, each program every NPROG-th.
#   kv_order_kernel  grid (N_Q_TILES, BH): per query-tile row, counts and indices of the partial
#                    and full KV tiles (kv_num_blocks / kv_indices / full_kv_*).
#   q_order_kernel   grid (N_KV_TILES, BH): the same per KV-tile column (q_* / full_q_*).
# The order kernels may read a rectangle of the state (Q0, KV0): one classification gives the
# tables of several block masks whose tiles it holds (flexattn.distributed's pairs of shards).
#
# Index layout (torch's, from a stable descending argsort of the 0/1 tile row): a row of
# *_indices holds the selected tiles in ascending order, then all other tiles in ascending order.
#
# [Note] Sequence tails: elements past Q_LEN / KV_LEN count as masked out (torch pads the dense
# mask with False), so a tile cut by the sequence end is never full, and it is partial iff any
# in-range element is true. Out-of-range indices are clamped before mask_mod sees them.
#
# sub notation:
#   BLOCK_Q, BLOCK_KV: tile (sparse block) sizes; SUB_Q, SUB_KV: sub-tile evaluated at once
#   CHUNK_WORDS: words (x16 tiles) classified per loop step; CHUNK: tiles per step when ordering
#   USE_INTERVAL: decide tiles by interval analysis first (else evaluate every tile)
#   SEPARATE_FULL: full tiles go to full_* (else every non-empty tile is "partial")
#   HD: heads in the evaluated grid (program_id(1) = b * HD + h)
#   Deferred: int64 [1 + CAP]: the count of listed tiles (zeroed before classify_kernel; it may pass
#             CAP), then the tiles as bh << 40 | query-tile row << 20 | KV tile, -1 for a slot
#             reserved past CAP by a chunk that then evaluated its tiles itself
#   DEFER_MIN: undecided tiles of a chunk from which they are listed (0: never)
#   Q0, KV0: the order kernels' rectangle corner (first query-tile row, first KV-tile column of
#            the state they list); their N_Q_TILES / N_KV_TILES are the rectangle's rows / columns
#   RECTS: the order kernels list several rectangles in one launch, one per program_id(2), each
#          read from its row of Rects (int64 [R, 8]: Q0, N_Q_TILES, KV0, N_KV_TILES, then the
#          offsets of its tables in the outputs: KV-order counts, Q-order counts, indices); the
#          scalar sizes are then the grid's bounds (the largest rectangle's) and unread
$prelude

$mod_def

$interval_def

# Reductions go through tl.reduce / tl.associative_scan: the helpers in triton.language.standard
# (tl.sum, tl.max, tl.cumsum, tl.zeros) are jit functions that the CPU interpreter cannot call from
# generated modules, while it runs these standard combine functions natively (numpy).
_sum_op = tl.standard._sum_combine
_max_op = tl.standard._elementwise_max
_min_op = tl.standard._elementwise_min


@triton.jit
def _tile_max(x):
    return tl.reduce(tl.reduce(x, 1, _max_op), 0, _max_op)


@triton.jit
def _tile_min(x):
    return tl.reduce(tl.reduce(x, 1, _min_op), 0, _min_op)


EMPTY = tl.constexpr(0)
PARTIAL = tl.constexpr(1)
FULL = tl.constexpr(2)
UNKNOWN = tl.constexpr(3)


@triton.jit
def _exact_sub(
    b, h, q0, kv0, Q_LEN, KV_LEN, $mod_params
    SUB_Q: tl.constexpr, SUB_KV: tl.constexpr,
):
    # -- mask_mod on one sub-tile: (any element kept, every element kept), padding masked out
    q_idx = q0 + tl.arange(0, SUB_Q)[:, None]
    kv_idx = kv0 + tl.arange(0, SUB_KV)[None, :]
    inside = (q_idx < Q_LEN) & (kv_idx < KV_LEN)
    q_idx = tl.minimum(q_idx, Q_LEN - 1)
    kv_idx = tl.minimum(kv_idx, KV_LEN - 1)
    keep = ($mod_call) & inside
    keep = keep.to(tl.int32)
    return _tile_max(keep), _tile_min(keep)


# Sub-tiles per tile up to which the loops over them are unrolled (a 128 x 128 tile has 4 on the
# GPU). Past it they run as loops that stop at the sequence end: a tile larger than the sequence
# (BLOCK_SIZE=2**20 on a short one) is evaluated over its real elements only.
UNROLL_SUBS = tl.constexpr(16)


@triton.jit
def _exact_tile(
    b, h, q_lo, kv_lo, Q_LEN, KV_LEN, $mod_params
    BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr, SUB_Q: tl.constexpr, SUB_KV: tl.constexpr,
):
    # -- evaluate mask_mod on every element of one tile: empty, partial or full
    any_true = tl.full([], 0, tl.int32)
    all_true = tl.full([], 1, tl.int32)
    if (BLOCK_Q // SUB_Q) * (BLOCK_KV // SUB_KV) <= UNROLL_SUBS:
        for sq in tl.static_range(0, BLOCK_Q, SUB_Q):
            for sk in tl.static_range(0, BLOCK_KV, SUB_KV):
                most, least = _exact_sub(b, h, q_lo + sq, kv_lo + sk, Q_LEN, KV_LEN, $mod_params SUB_Q, SUB_KV)
                any_true = tl.maximum(any_true, most)
                all_true = tl.minimum(all_true, least)
    else:
        # (a tile cut by the sequence end is never full: all_true drops to 0 below)
        for sq in range(0, tl.minimum(BLOCK_Q, Q_LEN - q_lo), SUB_Q):
            for sk in range(0, tl.minimum(BLOCK_KV, KV_LEN - kv_lo), SUB_KV):
                most, least = _exact_sub(b, h, q_lo + sq, kv_lo + sk, Q_LEN, KV_LEN, $mod_params SUB_Q, SUB_KV)
                any_true = tl.maximum(any_true, most)
                all_true = tl.minimum(all_true, least)
        cut = (q_lo + BLOCK_Q > Q_LEN) | (kv_lo + BLOCK_KV > KV_LEN)
        all_true = tl.where(cut, 0, all_true)
    return tl.where(all_true == 1, FULL, tl.where(any_true == 1, PARTIAL, EMPTY))


# Lengths, and everything that grows with them, are not specialised on (no recompilation for a
# new sequence length: a BlockMask of new lengths reuses the compiled kernels).
@triton.jit(do_not_specialize=[$classify_nospec"stride_sbh", "stride_sm", "HD", "Q_LEN", "KV_LEN", "N_KV_TILES", "N_WORDS"])
def classify_kernel(
$classify_kernel_params
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // HD
    h = pid_bh % HD
    q_lo = pid_m * BLOCK_Q
    q_hi = tl.minimum(q_lo + BLOCK_Q, Q_LEN) - 1
    q_whole = q_lo + BLOCK_Q <= Q_LEN
    row = State + pid_bh.to(tl.int64) * stride_sbh + pid_m.to(tl.int64) * stride_sm
    offs_w = tl.arange(0, CHUNK_WORDS)
    lane = tl.arange(0, 16)
    for w0 in range(0, N_WORDS, CHUNK_WORDS):
        words_idx = w0 + offs_w
        tile = words_idx[:, None] * 16 + lane[None, :]  # [CHUNK_WORDS, 16] KV tile ids
        real = tile < N_KV_TILES
        kv_lo = tile * BLOCK_KV
        whole = q_whole & (kv_lo + BLOCK_KV <= KV_LEN)
        if USE_INTERVAL:
            # -- decide tiles from the ranges of their indices (padding lanes get a valid range)
            lo_kv = tl.where(real, kv_lo, 0)
            hi_kv = tl.where(real, tl.minimum(kv_lo + BLOCK_KV, KV_LEN) - 1, 0)
            lo, hi = $interval_call
            state = tl.where(lo == 1, FULL, tl.where(hi == 0, EMPTY, UNKNOWN))
            state = tl.where((state == FULL) & (whole == 0), PARTIAL, state)
        else:
            state = tl.full([CHUNK_WORDS, 16], UNKNOWN, tl.int32)
        state = tl.where(real, state, EMPTY)
        words = tl.reduce(state << (2 * lane)[None, :], 1, _sum_op)  # disjoint bit fields: sum == or
        listed = w0 < 0  # (false)
        if DEFER_MIN > 0:
            unknown = tl.reshape((state == UNKNOWN).to(tl.int32), [CHUNK_WORDS * 16])
            n_unknown = tl.reduce(unknown, 0, _sum_op)
            if n_unknown >= DEFER_MIN:
                # -- list them for exact_kernel: slots base.. in the chunk's order (the words keep
                # UNKNOWN, which exact_kernel overwrites); past CAP, the chunk evaluates them below
                base = tl.atomic_add(Deferred, n_unknown.to(tl.int64))
                listed = base + n_unknown <= CAP
                slot = base + (tl.associative_scan(unknown, 0, _sum_op) - unknown)
                ids = tl.reshape(tile, [CHUNK_WORDS * 16]).to(tl.int64)
                entry = (pid_bh.to(tl.int64) << 40) | (pid_m.to(tl.int64) << 20) | ids
                tl.store(Deferred + 1 + slot, tl.where(listed, entry, -1), mask=(unknown == 1) & (slot < CAP))
        if listed:
            tl.store(row + words_idx, words, mask=words_idx < N_WORDS)
        elif _tile_max(state) == UNKNOWN:
            # -- evaluate the undecided tiles of this chunk one by one
            for k in range(CHUNK_WORDS):
                word = tl.reduce(tl.where(offs_w == k, words, 0), 0, _sum_op)
                w = w0 + k
                for t in range(16):
                    s = (word >> (2 * t)) & 3
                    if s == UNKNOWN:
                        s = _exact_tile(b, h, q_lo, (w * 16 + t) * BLOCK_KV, Q_LEN, KV_LEN, $mod_params
                                        BLOCK_Q, BLOCK_KV, SUB_Q, SUB_KV)
                        # int32 arithmetic: 3 << 30 must wrap (the interpreter would make it a Python int)
                        word = (word & ~(tl.full([], 3, tl.int32) << (2 * t))) | (s << (2 * t))
                tl.store(row + w, word, mask=w < N_WORDS)
        else:
            tl.store(row + words_idx, words, mask=words_idx < N_WORDS)


@triton.jit(do_not_specialize=[$classify_nospec"stride_sbh", "stride_sm", "HD", "Q_LEN", "KV_LEN", "CAP"])
def exact_kernel(
$exact_kernel_params
):
    # -- the tiles classify_kernel listed, each evaluated element by element; its 2 bits of the
    # state word (UNKNOWN: both set) are cleared to the tile's state by an atomic and (other
    # programs write the other tiles of the word)
    count = tl.minimum(tl.load(Deferred), CAP).to(tl.int32)
    for i in range(tl.program_id(0), count, NPROG):
        entry = tl.load(Deferred + 1 + i)
        if entry >= 0:
            bh = (entry >> 40).to(tl.int32)
            m = ((entry >> 20) & 0xFFFFF).to(tl.int32)
            t = (entry & 0xFFFFF).to(tl.int32)
            s = _exact_tile(bh // HD, bh % HD, m * BLOCK_Q, t * BLOCK_KV, Q_LEN, KV_LEN, $mod_params
                            BLOCK_Q, BLOCK_KV, SUB_Q, SUB_KV)
            word = State + bh.to(tl.int64) * stride_sbh + m.to(tl.int64) * stride_sm + t // 16
            # (int32: 3 << 30 must wrap, as in classify_kernel)
            tl.atomic_and(word, ~((tl.full([], 3, tl.int32) ^ s) << (2 * (t % 16))))


@triton.jit
def _states(Words, i, real, stride, lane, COLUMN: tl.constexpr):
    # Row of tiles: tile `lane + i` sits in word (lane + i) // 16 (`lane`: the row's first tile).
    # Column (KV tile `lane` of word column Words): query-tile row i's word is Words + i * stride.
    if COLUMN:
        word = tl.load(Words + i.to(tl.int64) * stride, mask=real, other=0)
        return (word >> (2 * lane)) & 3
    else:
        t = lane + i
        word = tl.load(Words + t // 16, mask=real, other=0)
        return (word >> (2 * (t % 16))) & 3


@triton.jit
def _selected(st, real, SELECT: tl.constexpr):
    if SELECT == 0:  # no separate full tiles: every non-empty tile counts
        return ((st != EMPTY) & real).to(tl.int32)
    else:
        return ((st == SELECT) & real).to(tl.int32)


@triton.jit
def _count(Words, N, stride, lane, SELECT: tl.constexpr, COLUMN: tl.constexpr, CHUNK: tl.constexpr):
    offs = tl.arange(0, CHUNK)
    n = tl.full([], 0, tl.int32)
    for c in range(0, N, CHUNK):
        i = c + offs
        real = i < N
        n += tl.reduce(_selected(_states(Words, i, real, stride, lane, COLUMN), real, SELECT), 0, _sum_op)
    return n


@triton.jit
def _order(Words, N, stride, lane, Num, Idx,
           SELECT: tl.constexpr, COLUMN: tl.constexpr, CHUNK: tl.constexpr):
    # -- one row of an index table: selected tiles ascending, then the others ascending
    n_sel = _count(Words, N, stride, lane, SELECT, COLUMN, CHUNK)
    offs = tl.arange(0, CHUNK)
    seen = tl.full([], 0, tl.int32)
    for c in range(0, N, CHUNK):
        i = c + offs
        real = i < N
        sel = _selected(_states(Words, i, real, stride, lane, COLUMN), real, SELECT)
        before = seen + tl.associative_scan(sel, 0, _sum_op) - sel  # selected tiles before tile i
        pos = tl.where(sel == 1, before, n_sel + i - before)
        tl.store(Idx + pos, i, mask=real)
        seen += tl.reduce(sel, 0, _sum_op)
    tl.store(Num, n_sel)


@triton.jit
def _rect(Rects, n_q, n_kv, q0, kv0, NUM_AT: tl.constexpr, RECTS: tl.constexpr):
    # -- this program's rectangle: (n_q, n_kv, q0, kv0, counts offset, indices offset)
    if RECTS:
        row = Rects + tl.program_id(2) * 8
        return (tl.load(row + 1), tl.load(row + 3), tl.load(row).to(tl.int64), tl.load(row + 2),
                tl.load(row + NUM_AT), tl.load(row + 6))
    else:
        return n_q, n_kv, q0.to(tl.int64), kv0, 0, 0


# Both order kernels list the tiles of a rectangle of the state: query-tile rows Q0 .. Q0 +
# N_Q_TILES - 1 against KV-tile columns KV0 .. KV0 + N_KV_TILES - 1, numbered from its corner (the
# tables of a block mask of those rows and columns; 0, 0 and the whole state for the whole mask),
# or (RECTS) several rectangles, one per program_id(2).
@triton.jit(do_not_specialize=["stride_sbh", "stride_sm", "N_Q_TILES", "N_KV_TILES", "Q0", "KV0"])
def kv_order_kernel(
$kv_order_kernel_params
):
    # SEL: the state listed in KvIdx (PARTIAL, or 0 = any non-empty when not SEPARATE_FULL)
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    n_q, n_kv, q0, kv0, num_at, idx_at = _rect(Rects, N_Q_TILES, N_KV_TILES, Q0, KV0, 4, RECTS)
    if pid_m < n_q:
        words = State + pid_bh.to(tl.int64) * stride_sbh + (q0 + pid_m) * stride_sm
        row = pid_bh.to(tl.int64) * n_q + pid_m
        _order(words, n_kv, 0, kv0, KvNum + num_at + row, KvIdx + idx_at + row * n_kv, SEL, False, CHUNK)
        if SEPARATE_FULL:
            _order(words, n_kv, 0, kv0, FullNum + num_at + row, FullIdx + idx_at + row * n_kv, FULL, False, CHUNK)


@triton.jit(do_not_specialize=["stride_sbh", "stride_sm", "N_Q_TILES", "N_KV_TILES", "Q0", "KV0"])
def q_order_kernel(
$q_order_kernel_params
):
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    n_q, n_kv, q0, kv0, num_at, idx_at = _rect(Rects, N_Q_TILES, N_KV_TILES, Q0, KV0, 5, RECTS)
    if pid_n < n_kv:
        c = kv0 + pid_n
        words = State + pid_bh.to(tl.int64) * stride_sbh + q0 * stride_sm + c // 16
        lane = c % 16
        col = pid_bh.to(tl.int64) * n_kv + pid_n
        _order(words, n_q, stride_sm, lane, QNum + num_at + col, QIdx + idx_at + col * n_q, SEL, True, CHUNK)
        if SEPARATE_FULL:
            _order(words, n_q, stride_sm, lane, FullNum + num_at + col, FullIdx + idx_at + col * n_q, FULL, True, CHUNK)
