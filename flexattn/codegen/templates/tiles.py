# Tile helpers shared by the forward and backward templates (inserted at their $tile_helpers hook).
# Not a module of its own: it relies on the `triton` / `tl` imports of the template around it.


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
def mma(a, b, acc, DOT_PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr):
    if DOT_IN_FP32:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), acc.to(tl.float32), input_precision=DOT_PRECISION)
    else:
        out = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    return out.to(acc.dtype)
