# Tile helpers shared by the forward, backward and decode templates (inserted at their $tile_helpers
# hook). Not a module of its own: it relies on the `triton` / `tl` imports of the template around it,
# and it never calls the mods (their hooks differ between templates).
#
# Vocabulary, the same in every template: `offs_m` query rows, `offs_n` KV positions, `offs_k` /
# `offs_v` columns of the QK / V head dims; CHECK_ROWS / CHECK_COLS say which bounds a load or store
# may cross (callers pass `not IS_DIVISIBLE` and `not SAFE_HEAD_DIM`). All of these are inlined.


@triton.jit
def ptr_offsets(offs, OFFS_INT64: tl.constexpr):
    # `offs` as pointer offsets: int64 when some tensor spans more than 2^31 elements.
    if OFFS_INT64:
        out = offs.to(tl.int64)
    else:
        out = offs
    return out


@triton.jit
def load_tile(ptrs, rows, cols, N_ROWS, N_COLS, CHECK_ROWS: tl.constexpr, CHECK_COLS: tl.constexpr):
    # Zeros outside [0, N_ROWS) x [0, N_COLS); only the bounds that may be crossed are checked.
    if CHECK_ROWS and CHECK_COLS:
        x = tl.load(ptrs, mask=(rows[:, None] < N_ROWS) & (cols[None, :] < N_COLS), other=0.0)
    elif CHECK_ROWS:
        x = tl.load(ptrs, mask=rows[:, None] < N_ROWS, other=0.0)
    elif CHECK_COLS:
        x = tl.load(ptrs, mask=cols[None, :] < N_COLS, other=0.0)
    else:
        x = tl.load(ptrs)
    return x


@triton.jit
def store_tile(ptrs, x, rows, cols, N_ROWS, N_COLS, CHECK_ROWS: tl.constexpr, CHECK_COLS: tl.constexpr):
    if CHECK_ROWS and CHECK_COLS:
        tl.store(ptrs, x, mask=(rows[:, None] < N_ROWS) & (cols[None, :] < N_COLS))
    elif CHECK_ROWS:
        tl.store(ptrs, x, mask=rows[:, None] < N_ROWS)
    elif CHECK_COLS:
        tl.store(ptrs, x, mask=cols[None, :] < N_COLS)
    else:
        tl.store(ptrs, x)


@triton.jit
def widen(x):
    # x as float64, exactly. Narrower floats go through float32: the interpreter converts bfloat16
    # and float8 straight to float64 with a bit-level routine that fails on zeros.
    if x.dtype != tl.float64:
        x = x.to(tl.float32)
    return x.to(tl.float64)


@triton.jit
def mma(a, b, acc, DOT_PRECISION: tl.constexpr, DOT_IN_FP64: tl.constexpr):
    # acc + a @ b in acc's dtype. DOT_IN_FP64 (Triton's interpreter only): float64 copies of the
    # operands. The interpreter's tl.dot is numpy's matmul on the host BLAS, whose float32 product
    # need not be IEEE float32 on every CPU, and it gets bfloat16 arithmetic wrong; float64 copies
    # make the products exact and the sums at least float32-accurate whatever the BLAS.
    if DOT_IN_FP64:
        out = tl.dot(widen(a), widen(b), acc.to(tl.float64), input_precision=DOT_PRECISION, out_dtype=tl.float64)
    else:
        out = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    return out.to(acc.dtype)


@triton.jit
def row_max(x):
    # tl.max(x, 1) spelled as the reduction it is. Triton's interpreter cannot call standard-library
    # jit functions (tl.max, tl.sum, tl.zeros) unless triton itself was imported in interpreter
    # mode, but it runs tl.reduce with these combine functions natively (numpy).
    return tl.reduce(x, 1, tl.standard._elementwise_max)


@triton.jit
def row_sum(x):
    return tl.reduce(x, 1, tl.standard._sum_combine)


@triton.jit
def online_softmax(s, m_i, l_i, ROWS_GUARANTEED_SAFE: tl.constexpr):
    # One step of the online softmax for scores s in natural units (see online_softmax_scaled).
    RCP_LN2: tl.constexpr = 1.4426950408889634
    return online_softmax_scaled(s, RCP_LN2, m_i, l_i, ROWS_GUARANTEED_SAFE)


@triton.jit
def online_softmax_scaled(s, c, m_i, l_i, ROWS_GUARANTEED_SAFE: tl.constexpr):
    # One step of the online softmax in base 2 of the scores s * c, for a scalar c > 0 (a positive
    # factor commutes with the row max, so the multiply folds into exp2's argument as one FMA per
    # score instead of a multiply and a subtract). s: this tile's masked scores (-inf where
    # masked); m_i, l_i: the running row max (of s * c) and row sum. Returns p (this tile's
    # unnormalised probabilities), alpha (rescales what was accumulated so far) and the new l_i,
    # m_i; the caller accumulates acc * alpha + p @ v in its own way.
    m_ij = tl.maximum(m_i, row_max(s) * c)
    if ROWS_GUARANTEED_SAFE:
        m_ref = m_ij
    else:
        # [Note] fully masked rows: while a row has seen only -inf, m_ij is -inf and s - m_ij
        # would be NaN. Measure from 0 instead: p and alpha come out 0, l_i stays 0.
        m_ref = tl.where(m_ij == float("-inf"), 0.0, m_ij)
    p = tl.exp2(s * c - m_ref[:, None])
    alpha = tl.exp2(m_i - m_ref)
    l_i = l_i * alpha + row_sum(p)
    return p, alpha, l_i, m_ij


@triton.jit
def add_sink(m_i, l_i, sink):
    # The epilogue's attention sink: a term 2^sink (in m_i's base-2 units) joins each row's sum,
    # with no value row. Returns the new row max and sum and the factor that rescales the rows'
    # accumulator. A row that saw nothing (m_i = -inf, l_i = 0) gets m = sink, l = 1, factor 0.
    m_new = tl.maximum(m_i, sink)
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # (a sink of -inf on an empty row: l stays 0)
    alpha = tl.exp2(m_i - m_ref)
    return m_new, l_i * alpha + tl.exp2(sink - m_ref), alpha


@triton.jit
def next_start(start, i, BLOCK_IDX, num_blocks, STEP: tl.constexpr, SPARSE_MULTIPLE: tl.constexpr,
               SPARSE_BLOCK_SIZE: tl.constexpr, BLOCKS_ARE_CONTIGUOUS: tl.constexpr):
    # The block-sparse walk's next tile after tile i: STEP further inside this sparse block, or the
    # start of the next block listed at BLOCK_IDX (num_blocks entries, SPARSE_MULTIPLE tiles each).
    if BLOCKS_ARE_CONTIGUOUS:
        start += STEP
    else:
        nxt = i + 1
        jump = nxt % SPARSE_MULTIPLE == 0
        nxt_block = tl.load(BLOCK_IDX + nxt // SPARSE_MULTIPLE,
                            mask=jump & (nxt < num_blocks * SPARSE_MULTIPLE), other=0)
        start = tl.where(jump, nxt_block * SPARSE_BLOCK_SIZE, start + STEP)
    return start
