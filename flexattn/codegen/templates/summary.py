# The min/max pyramid of a 1-D integer or bool tensor (flexattn.interval.Summary, the bounds of a
# mask's gathers from it), in two launches instead of one torch reduction per level.
#
# Level 0 holds the min / max of each GRANULE elements (the tail padded with the last element),
# level k + 1 of each pair of level-k entries, up to level K (one entry); level k starts at
# (2 << K) - (2 << (K - k)) in MINS / MAXS (int64, 2 ** (K + 1) - 1 entries each).
#
# pyramid_kernel, grid (2 ** (K - L),): program p reads elements p * 2 ** L * GRANULE onwards and
# writes levels 0 .. L of its part. top_kernel, grid (1,), for K > L: reads level L (2 ** (K - L)
# entries) and writes levels L + 1 .. K.
#
# sub notation:
#   N: elements;  K: the top level;  L: levels a pyramid_kernel program ends at (L <= K)
$prelude

_min_op = tl.standard._elementwise_min
_max_op = tl.standard._elementwise_max


@triton.jit
def _levels(lo, hi, Mins, Maxs, p, K: tl.constexpr, FIRST: tl.constexpr, LEVELS: tl.constexpr):
    # lo / hi: the 2 ** LEVELS entries of level FIRST that block p of that level holds; stores them
    # and the levels above them, up to FIRST + LEVELS
    for j in tl.static_range(LEVELS + 1):
        at = (2 << K) - (2 << (K - FIRST - j)) + p * (1 << (LEVELS - j)) + tl.arange(0, 1 << (LEVELS - j))
        tl.store(Mins + at, lo)
        tl.store(Maxs + at, hi)
        if j < LEVELS:
            lo = tl.reduce(tl.reshape(lo, (1 << (LEVELS - j - 1), 2)), 1, _min_op)
            hi = tl.reduce(tl.reshape(hi, (1 << (LEVELS - j - 1), 2)), 1, _max_op)


@triton.jit(do_not_specialize=["N"])
def pyramid_kernel(X, Mins, Maxs, N, K: tl.constexpr, L: tl.constexpr, GRANULE: tl.constexpr):
    p = tl.program_id(0)
    E: tl.constexpr = 1 << L
    i = p * (E * GRANULE) + tl.arange(0, E * GRANULE)
    x = tl.reshape(tl.load(X + tl.minimum(i, N - 1)).to(tl.int64), (E, GRANULE))
    _levels(tl.reduce(x, 1, _min_op), tl.reduce(x, 1, _max_op), Mins, Maxs, p, K, 0, L)


@triton.jit
def top_kernel(Mins, Maxs, K: tl.constexpr, L: tl.constexpr):
    at = (2 << K) - (2 << (K - L)) + tl.arange(0, 1 << (K - L))
    _levels(tl.load(Mins + at), tl.load(Maxs + at), Mins, Maxs, 0, K, L, K - L)
