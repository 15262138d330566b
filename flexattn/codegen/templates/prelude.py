# Helper functions shared by all mods of one generated module (`flexattn.codegen.emit.prelude`
# puts them after its imports). Not a module of its own: it is cut into sections at the
# `# == section <name>` lines, and `prelude` joins the sections one target needs:
#
#   common            every target
#   cuda              "cuda" and "gluon": libdevice math
#   interpret         Triton's CPU interpreter, which has no libdevice: the same functions composed
#                     from core ops, accurate to a few ulp on the ranges mods use (they are what CPU
#                     tests run, against torch's eager results with tolerances)
#   tanh_f32_precise  float32 tanh as `_fa_tanh`
#   tanh_f32_fast     float32 tanh as PTX tanh.approx.f32 (`fast_math`, GPU only): one MUFU
#                     instruction instead of libdevice's polynomial (about twice the soft-capping
#                     throughput); absolute error about 2**-11, below bfloat16/float16 score rounding
#   exact_sum         `_fa_atomic_add_exact`: order-independent sums (`exact_sums`: the deterministic
#                     backward's captured-tensor gradients)
#
# Every section is emitted as it stands here, framed by one blank line before and none after.

# == section common
@triton.jit
def _fa_floordiv_int_nz(a, b):
    # Python floor division on integers by a divisor known not to be 0 (a constant).
    q = a // b
    r = a - q * b
    return tl.where((r != 0) & ((r < 0) != (b < 0)), q - 1, q)


@triton.jit
def _fa_mod_int_nz(a, b):
    # Python-sign modulo on integers by a divisor known not to be 0 (a constant).
    r = a % b
    return tl.where((r != 0) & ((r < 0) != (b < 0)), r + b, r)


@triton.jit
def _fa_floordiv_int(a, b):
    # Python floor division on integers (Triton's // truncates toward zero). x // 0 is 0 on every
    # flexattn path (docs/dsl.md); the divisor 0 is replaced by 1 so nothing traps.
    zero = b == 0
    d = b + zero.to(b.dtype)
    q = a // d
    r = a - q * d
    q = tl.where((r != 0) & ((r < 0) != (d < 0)), q - 1, q)
    return tl.where(zero, q * 0, q)


@triton.jit
def _fa_mod_int(a, b):
    # Python-sign modulo on integers (the result takes the divisor's sign); x % 0 is x, so that
    # (x // y) * y + x % y == x holds for every y.
    zero = b == 0
    d = b + zero.to(b.dtype)
    r = a % d
    r = tl.where((r != 0) & ((r < 0) != (d < 0)), r + d, r)
    return tl.where(zero, a + r * 0, r)


@triton.jit
def _fa_mod_float(a, b):
    # torch.remainder on floats: from the exact fmod, so 1.0 % 0.1 == 0.09999999999999995 like
    # Python (a - b * floor(a / b) gives 0 there).
    r = _fa_fmod(a, b)
    return tl.where((r != 0) & ((r < 0) != (b < 0)), r + b, r)


@triton.jit
def _fa_floordiv_float(a, b):
    # torch.floor_divide on floats (Python's //), step by step as torch computes it: 1.0 // 0.1
    # is 9.0 (floor(1.0 / 0.1) would be 10.0).
    q = a / b
    r = _fa_fmod(a, b)
    div = (a - r) / b
    div = tl.where((r != 0) & ((b < 0) != (r < 0)), div - 1.0, div)
    fl = tl.floor(div)
    fl = tl.where(div - fl > 0.5, fl + 1.0, fl)
    q_neg = (q < 0) | ((q == 0) & (1.0 / q < 0))  # signbit(q), -0.0 included
    out = tl.where(div != 0, fl, tl.where(q_neg, -0.0, 0.0))
    return tl.where(b == 0, q, out)


@triton.jit
def _fa_sign(x):
    return tl.where(x > 0, 1, tl.where(x < 0, -1, 0)).to(x.dtype)

# == section cuda
@triton.jit
def _fa_fmod(a, b):
    # Exact remainder (Triton's float % lowers to an inexact a - b * trunc(a / b) on NVPTX).
    return libdevice.fmod(a, b)


@triton.jit
def _fa_to_bf16(x):
    return x.to(tl.bfloat16)


@triton.jit
def _fa_and(a, b):
    return a & b


@triton.jit
def _fa_or(a, b):
    return a | b


@triton.jit
def _fa_xor(a, b):
    return a ^ b

@triton.jit
def _fa_tanh(x):
    return libdevice.tanh(x)


@triton.jit
def _fa_tan(x):
    return libdevice.tan(x)


@triton.jit
def _fa_expm1(x):
    return libdevice.expm1(x)


@triton.jit
def _fa_log1p(x):
    return libdevice.log1p(x)


@triton.jit
def _fa_pow(a, b):
    return libdevice.pow(a, b)


@triton.jit
def _fa_round(x):
    return libdevice.rint(x)


@triton.jit
def _fa_trunc(x):
    return libdevice.trunc(x)

# == section interpret
@triton.jit
def _fa_fmod(a, b):
    # The interpreter computes float % with numpy.fmod: exact.
    return a % b


@triton.jit
def _fa_to_bf16(x):
    # float32 -> bfloat16 rounding to nearest even: the interpreter's own conversion truncates.
    u = x.to(tl.uint32, bitcast=True)
    r = (u + tl.full([], 0x7FFF, tl.uint32) + ((u >> 16) & tl.full([], 1, tl.uint32))) >> 16
    r = tl.where(x != x, (u >> 16) | tl.full([], 0x40, tl.uint32), r)  # NaN stays (quiet) NaN
    return r.to(tl.uint16).to(tl.bfloat16, bitcast=True)


# bool & | ^: the interpreter cannot combine a bool scalar (b < 1, a 0-d load) with a bool tile
# (it broadcasts int1 scalars into int32 storage); as int8 it can.
@triton.jit
def _fa_and(a, b):
    return (a.to(tl.int8) & b.to(tl.int8)) != 0


@triton.jit
def _fa_or(a, b):
    return (a.to(tl.int8) | b.to(tl.int8)) != 0


@triton.jit
def _fa_xor(a, b):
    return (a.to(tl.int8) ^ b.to(tl.int8)) != 0

@triton.jit
def _fa_tanh(x):
    # tanh(x) = sign(x) * (1 - e) / (1 + e), e = exp(-2|x|); a series avoids cancellation near 0.
    ax = tl.abs(x)
    e = tl.exp(-2.0 * ax)
    big = (1.0 - e) / (1.0 + e)
    x2 = x * x
    small = ax * (1.0 - x2 * (0.3333333333333333 - x2 * (0.13333333333333333 - x2 * 0.05396825396825397)))
    y = tl.where(ax < 0.0625, small, big)
    return tl.where(x < 0, -y, y)


@triton.jit
def _fa_tan(x):
    return tl.sin(x) / tl.cos(x)


@triton.jit
def _fa_expm1(x):
    # Series near 0, where exp(x) - 1 cancels.
    small = x * (1.0 + x * (0.5 + x * (0.16666666666666666 + x * 0.041666666666666664)))
    return tl.where(tl.abs(x) < 0.03125, small, tl.exp(x) - 1.0)


@triton.jit
def _fa_log1p(x):
    # log1p(x) = log(u) * x / (u - 1) with u = 1 + x (Goldberg's trick), exact where u == 1;
    # log1p(inf) is inf (x / (u - 1) would be inf / inf).
    u = 1.0 + x
    d = u - 1.0
    safe_d = tl.where((d == 0) | (d == float("inf")), 1.0, d)
    return tl.where((d == 0) | (d == float("inf")), x, tl.log(u) * (x / safe_d))


@triton.jit
def _fa_pow(a, b):
    # IEEE pow, as torch: the magnitude exp2(b * log2|a|), then the sign and the special cases.
    # Values from a alone and from b alone combine through tl.where (a scalar | a tile: see _fa_and).
    mag = tl.exp2(b * tl.log2(tl.abs(a)))
    b_inf = tl.abs(b) == float("inf")
    b_int = (tl.floor(b) == b) & (tl.abs(b) != float("inf"))
    b_odd = b_int & (_fa_mod_float(b, 2.0 + 0.0 * b) == 1.0)
    a_neg = (a < 0) | ((a == 0) & (1.0 / a < 0))  # signbit(a): -0.0 ** -1 is -inf
    mag = tl.where(b_inf, tl.where(tl.abs(a) == 1.0, 1.0, mag), mag)  # (-1) ** inf: inf * 0 is nan
    out = tl.where(b_odd, tl.where(a_neg, mag * -1.0, mag), mag)  # (-mag is 0 - mag: +0.0)
    # a finite negative base to a finite non-integer power has no real value
    no_real = (a < 0) & (a != -float("inf"))
    out = tl.where(b_int | b_inf, out, tl.where(no_real, float("nan"), out))
    one = tl.where(mag == mag, 1.0, 1.0)  # (not from mag: 0 ** 0, inf ** 0 and 1 ** nan are 1)
    return tl.where(b == 0, one, tl.where(a == 1, one, out))


@triton.jit
def _fa_round(x):
    # Round half to even, like torch.round. x - floor(x) is exact (floor(x + 0.5) is not:
    # 0.49999997 + 0.5 rounds up to 1.0 in float32).
    r = tl.floor(x)
    d = x - r
    odd = _fa_fmod(r, 2.0 + 0.0 * r) != 0
    return tl.where((d > 0.5) | ((d == 0.5) & odd), r + 1.0, r)


@triton.jit
def _fa_trunc(x):
    return tl.where(x < 0, tl.ceil(x), tl.floor(x))

# == section tanh_f32_precise
@triton.jit
def _fa_tanh_f32(x):
    return _fa_tanh(x)

# == section tanh_f32_fast
@triton.jit
def _fa_tanh_f32(x):
    return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                     pack=1)

# == section exact_sum
@triton.jit
def _fa_atomic_add_exact(G, x, mask):
    # Add x (float32 or float64) where mask into the exact sums at G: three 64-bit words per sum,
    # (hi, lo, special), whose final value does not depend on the order of the adds.
    # [Note] hi + lo * 2^-64 is a 128-bit two's-complement fixed-point number (hi the signed
    # integer part, lo the unsigned fraction). Integer addition is exact and associative, so
    # programs may add in any order and the words end the same. |x| is split exactly: floor(|x|),
    # then the fraction's two 32-bit halves (each converted from a whole float below 2^32, exact on
    # every backend); bits below 2^-64 are dropped (rounding toward zero, the same every time). A
    # negative x adds the two's complement. lo is added by an atomic that returns the old word:
    # the add carried out of 64 bits iff the new word is below the old one (unsigned), and that
    # carry goes into hi with the integer part. What fixed point cannot hold (|x| >= 2^63, inf,
    # nan) goes into the special word as float64 +-inf or nan: a float sum no order changes.
    # The host reads hi + lo * 2^-64 + special (`flexattn.kernels.backward.exact_sum_value`).
    TWO32: tl.constexpr = 4294967296.0
    LIMIT: tl.constexpr = 9223372036854775808.0  # 2^63
    a = tl.abs(x)
    fits = a < LIMIT  # (False for nan)
    a = tl.where(fits, a, 0.0)
    whole = tl.floor(a)
    frac = (a - whole) * TWO32
    upper = tl.floor(frac)
    lower = tl.floor((frac - upper) * TWO32)
    hi = whole.to(tl.int64)
    lo = (upper.to(tl.int64) << 32) | lower.to(tl.int64)
    neg = x < 0
    hi = tl.where(neg, -hi - (lo != 0).to(tl.int64), hi)
    lo = tl.where(neg, -lo, lo)
    add = mask & fits
    # (relaxed: each add is atomic, and no order between them is needed)
    old = tl.atomic_add(G + 1, lo, mask=add, sem="relaxed").to(tl.uint64, bitcast=True)
    carry = (old + lo.to(tl.uint64, bitcast=True)) < old
    hi = hi + carry.to(tl.int64)
    tl.atomic_add(G, hi, mask=add & (hi != 0), sem="relaxed")
    special = tl.where(x > 0, float("inf"), tl.where(x < 0, -float("inf"), x)).to(tl.float64)
    tl.atomic_add((G + 2).to(tl.pointer_type(tl.float64), bitcast=True), special, mask=mask & ~fits, sem="relaxed")
