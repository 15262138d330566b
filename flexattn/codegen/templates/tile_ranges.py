# The tiles a block mask keeps of each of several KV shards laid side by side (flexattn.distributed:
# a rank's queries against every KV shard at once), from the block-mask kernels' 2-bit tile state
# (templates/block_mask.py: STATE[BH, N_Q_TILES, N_WORDS], 16 tiles per int32 word, 0 = empty).
# Shard j holds KV tiles j * N .. j * N + N - 1. For each shard, OUT[j] (int32, 4 entries) gets
#   the first and last + 1 of its tiles (numbered from the shard's first) that any row keeps,
#   the first and last + 1 of the query-tile rows that keep any of its tiles,
# by atomic min / max: OUT must hold (N, 0, N_Q_TILES, 0) before the launch; a shard that no row
# reads keeps them (its last + 1 entries stay 0).
#
# grid (N_Q_TILES, SHARDS): one program per query-tile row and shard, every (batch, head) in turn.
# (32-bit offsets into STATE: it holds far fewer than 2**31 words.)
#
# sub notation:
#   BH: batch x head rows of STATE;  N: tiles per shard;  CHUNK: tiles per loop step (power of two)
$prelude

_min_op = tl.standard._elementwise_min
_max_op = tl.standard._elementwise_max


@triton.jit(do_not_specialize=["BH", "N", "stride_sbh", "stride_sm"])
def tile_ranges_kernel(State, Out, BH, N, stride_sbh, stride_sm, CHUNK: tl.constexpr):
    m = tl.program_id(0)
    j = tl.program_id(1)
    offs = tl.arange(0, CHUNK)
    first = tl.full([], 0, tl.int32) + N
    last = tl.full([], 0, tl.int32)
    for bh in range(BH):
        row = State + bh * stride_sbh + m * stride_sm
        for c in range(0, N, CHUNK):
            i = c + offs
            real = i < N
            t = j * N + i
            word = tl.load(row + t // 16, mask=real, other=0)
            kept = (((word >> (2 * (t % 16))) & 3) != 0) & real
            first = tl.minimum(first, tl.reduce(tl.where(kept, i, N), 0, _min_op))
            last = tl.maximum(last, tl.reduce(tl.where(kept, i + 1, 0), 0, _max_op))
    if last > 0:
        tl.atomic_min(Out + j * 4, first)
        tl.atomic_max(Out + j * 4 + 1, last)
        tl.atomic_min(Out + j * 4 + 2, m)
        tl.atomic_max(Out + j * 4 + 3, m + 1)
