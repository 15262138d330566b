# The merge of two partial attentions of the same rows by their log-sum-exp, in one pass (the
# ring's steps, flexattn/distributed/ring.py; host side: flexattn/kernels/merge.py). Row by row,
# with a = exp(LSE - top), c = exp(PLSE - top) and top the larger LSE:
#   R = (O a + PO c) / (a + c),   LSE = top + log(a + c)   (LSE overwritten in place)
# A row that neither part sees (both LSE -inf) comes out R = 0, LSE = -inf, never NaN. Float32
# math; R may be O itself (each element is read before it is written, by the same program).
#
# sub notation:
#   O, PO, R        [B, H, L, D], the last dimension contiguous (any other strides)
#   LSE, PLSE       [B, H, L] float32
#
# constexprs:
#   BLOCK_L         rows per program; the grid is flat: (row block, batch x head) in one axis, so
#                   that neither B x H nor the row blocks meet the grid's second-axis limit
#   BLOCK_D         D rounded up to a power of two
$prelude


@triton.jit
def _program_rows(H, N_ROW_BLOCKS, BLOCK_L: tl.constexpr):
    """(batch, head, rows) of this program: the flat grid's (row block, batch x head)."""
    pid = tl.program_id(0)
    bh = pid // N_ROW_BLOCKS
    rows = ((pid % N_ROW_BLOCKS) * BLOCK_L + tl.arange(0, BLOCK_L)).to(tl.int64)
    return (bh // H).to(tl.int64), (bh % H).to(tl.int64), rows


@triton.jit
def merge_kernel(O, LSE, PO, PLSE, R, H, L, D, N_ROW_BLOCKS,
                 stride_ob, stride_oh, stride_ol, stride_lb, stride_lh, stride_ll,
                 stride_pob, stride_poh, stride_pol, stride_plb, stride_plh, stride_pll,
                 stride_rb, stride_rh, stride_rl,
                 BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr):
    b, h, rows = _program_rows(H, N_ROW_BLOCKS, BLOCK_L)
    cols = tl.arange(0, BLOCK_D)
    keep = rows < L
    keep2 = keep[:, None] & (cols[None, :] < D)
    lse_ptrs = LSE + b * stride_lb + h * stride_lh + rows * stride_ll
    a = tl.load(lse_ptrs, mask=keep, other=-float("inf"))
    c = tl.load(PLSE + b * stride_plb + h * stride_plh + rows * stride_pll, mask=keep, other=-float("inf"))
    top = tl.maximum(a, c)
    top = tl.where(top == -float("inf"), 0.0, top)
    wa = tl.exp(a - top)
    wc = tl.exp(c - top)
    total = wa + wc
    safe = tl.where(total == 0.0, 1.0, total)
    o = tl.load(O + b * stride_ob + h * stride_oh + rows[:, None] * stride_ol + cols[None, :], mask=keep2,
                other=0.0)
    p = tl.load(PO + b * stride_pob + h * stride_poh + rows[:, None] * stride_pol + cols[None, :], mask=keep2,
                other=0.0)
    merged = o.to(tl.float32) * (wa / safe)[:, None] + p.to(tl.float32) * (wc / safe)[:, None]
    if R.dtype.element_ty == tl.bfloat16:
        out = _fa_to_bf16(merged)  # (rounds to nearest even in the interpreter too)
    else:
        out = merged.to(R.dtype.element_ty)
    tl.store(R + b * stride_rb + h * stride_rh + rows[:, None] * stride_rl + cols[None, :], out, mask=keep2)
    tl.store(lse_ptrs, tl.where(total == 0.0, -float("inf"), top + tl.log(safe)), mask=keep)


# The sum of a total and a part of its rows (the ring's dQ and dK/dV sums), in one pass:
#   R[l] = A[l] + P[l - LO]   for LO <= l < LO + PL,   R[l] = A[l] elsewhere
# float32 math rounded once into R's dtype; HAS_A False reads A as zeros. R may be A itself (each
# element is read before it is written, by the same program). Same layouts and grid as the merge:
#   A, P, R         [B, H, L (PL for P), D], the last dimension contiguous
@triton.jit
def add_rows_kernel(A, P, R, H, L, D, LO, PL, N_ROW_BLOCKS,
                    stride_ab, stride_ah, stride_al, stride_pb, stride_ph, stride_pl,
                    stride_rb, stride_rh, stride_rl,
                    HAS_A: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr):
    b, h, rows = _program_rows(H, N_ROW_BLOCKS, BLOCK_L)
    cols = tl.arange(0, BLOCK_D)
    keep = (rows < L)[:, None] & (cols[None, :] < D)
    in_part = keep & ((rows >= LO) & (rows < LO + PL))[:, None]
    total = tl.load(P + b * stride_pb + h * stride_ph + (rows - LO)[:, None] * stride_pl + cols[None, :],
                    mask=in_part, other=0.0).to(tl.float32)
    if HAS_A:
        a = tl.load(A + b * stride_ab + h * stride_ah + rows[:, None] * stride_al + cols[None, :], mask=keep,
                    other=0.0)
        total += a.to(tl.float32)
    if R.dtype.element_ty == tl.bfloat16:
        out = _fa_to_bf16(total)
    else:
        out = total.to(R.dtype.element_ty)
    tl.store(R + b * stride_rb + h * stride_rh + rows[:, None] * stride_rl + cols[None, :], out, mask=keep)
