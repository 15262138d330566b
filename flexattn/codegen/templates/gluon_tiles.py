# The Gluon templates' shared vocabulary (forward_hopper.py, backward_hopper.py and
# backward_dq_hopper.py take it at their gluon_tiles hook): the Gluon imports, the TMA load and
# store and the warp group's barrier under either Triton's names, base-2 constants, the order
# programs take their tiles in, a query block's KV lists, where the j-th tile of a program's
# block lists starts, and the loader's walk of a program's K/V tiles through a ring of
# shared-memory slots.
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait  # noqa: E402,E501

# triton >= 3.7 calls the TMA copies async_load / async_store
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
# the warp group's threads meet (bar.sync over a partition's warps): triton 3.6 thread_barrier, 3.9 barrier
_sync_warps = getattr(gl, "barrier", None) or gl.thread_barrier

LOG2E = gl.constexpr(1.4426950408889634)
LN2 = gl.constexpr(0.6931471805599453)


@gluon.jit
def tile_start(j, n_partial, P_IDX, F_IDX, TILES_PER_BLOCK: gl.constexpr, SPARSE_BLOCK_SIZE: gl.constexpr,
               BLOCK: gl.constexpr, BLOCKS_ARE_CONTIGUOUS: gl.constexpr):
    """First row (KV column in the forward, query row in the backward) of the j-th tile of BLOCK
    rows a program visits: the partial blocks' tiles (list P_IDX, n_partial tiles), then the full
    ones' (F_IDX). BLOCKS_ARE_CONTIGUOUS: each list's blocks are consecutive, only its first entry
    is read (the host's table without a block mask has no other)."""
    if j < n_partial:
        IDX = P_IDX
        t = j
    else:
        IDX = F_IDX
        t = j - n_partial
    if BLOCKS_ARE_CONTIGUOUS:
        start = gl.load(IDX) * SPARSE_BLOCK_SIZE + t * BLOCK
    else:
        start = gl.load(IDX + t // TILES_PER_BLOCK) * SPARSE_BLOCK_SIZE + (t % TILES_PER_BLOCK) * BLOCK
    return start


@gluon.jit
def kv_lists(KV_NUM_BLKS, KV_IDX, FULL_KV_NUM_BLKS, FULL_KV_IDX, b64, h, q_blk,
             stride_nz, stride_nh, stride_nm, stride_iz, stride_ih, stride_im,
             stride_fnz, stride_fnh, stride_fnm, stride_fiz, stride_fih, stride_fim,
             TILES_PER_BLOCK: gl.constexpr, HAS_FULL_BLOCKS: gl.constexpr):
    """(partial tiles, all tiles, partial list, full list) of query block q_blk of head h in the
    forward's lists (KV blocks per query block), tiles of SPARSE_KV_BLOCK_SIZE // TILES_PER_BLOCK;
    the same of a KV block in the transposed lists (backward_hopper.py's q_lists)."""
    n_partial = gl.load(KV_NUM_BLKS + b64 * stride_nz + h * stride_nh + q_blk * stride_nm) * TILES_PER_BLOCK
    P_IDX = KV_IDX + b64 * stride_iz + h * stride_ih + q_blk * stride_im
    F_IDX = FULL_KV_IDX + b64 * stride_fiz + h * stride_fih + q_blk * stride_fim
    n_tiles = n_partial
    if HAS_FULL_BLOCKS:
        n_tiles += gl.load(FULL_KV_NUM_BLKS + b64 * stride_fnz + h * stride_fnh + q_blk * stride_fnm) * TILES_PER_BLOCK
    return n_partial, n_tiles, P_IDX, F_IDX


@gluon.jit
def load_kv_ring(K, V, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty, b_kv, h_kv, n_partial, n_tiles,
                 P_IDX, F_IDX, TILES_PER_BLOCK: gl.constexpr, SPARSE_KV_BLOCK_SIZE: gl.constexpr,
                 BLOCK_N: gl.constexpr, BLOCKS_ARE_CONTIGUOUS: gl.constexpr, V_K_MAJOR: gl.constexpr, first=0):
    """TMA copies of a program's n_tiles K and V tiles (`tile_start`'s order) into the ring's
    slots: a slot is written once its consumers freed it (k_empty / v_empty) and says it landed
    on k_ready / v_ready. V_K_MAJOR: V is stored transposed (float8's K-major V). ``first``: how
    many tiles the ring took before these (a persistent program's earlier query tiles)."""
    NUM_BUFFERS: gl.constexpr = k_bufs.type.shape[0]
    for j in range(n_tiles):
        slot = (first + j) % NUM_BUFFERS
        phase = ((first + j) // NUM_BUFFERS) & 1
        start = tile_start(j, n_partial, P_IDX, F_IDX, TILES_PER_BLOCK, SPARSE_KV_BLOCK_SIZE, BLOCK_N,
                           BLOCKS_ARE_CONTIGUOUS)
        # a fresh barrier counts as having completed the phase before phase 0: the first round passes
        mbarrier.wait(k_empty.index(slot), phase ^ 1)
        mbarrier.expect(k_ready.index(slot), K.block_type.nbytes)
        _tma_load(K, [b_kv, h_kv, start, 0], k_ready.index(slot), k_bufs.index(slot))
        mbarrier.wait(v_empty.index(slot), phase ^ 1)
        mbarrier.expect(v_ready.index(slot), V.block_type.nbytes)
        if V_K_MAJOR:
            _tma_load(V, [b_kv, h_kv, 0, start], v_ready.index(slot), v_bufs.index(slot))
        else:
            _tma_load(V, [b_kv, h_kv, start, 0], v_ready.index(slot), v_bufs.index(slot))


@gluon.jit
def program_tile(HEAD_GROUP):
    """(tile, batch x head) of this program on a (tiles, B x heads) grid (`tile_order`)."""
    n_tiles = gl.num_programs(0)
    return tile_order(gl.program_id(1) * n_tiles + gl.program_id(0), n_tiles, gl.num_programs(1), HEAD_GROUP)


@gluon.jit
def tile_order(lin, n_tiles, n_bh, HEAD_GROUP):
    """(tile, batch x head) of the lin-th of n_tiles x n_bh tiles. The hardware starts the
    programs in the grid's linear order (a persistent kernel's programs take lin = program,
    program + programs, ...); they take the heads HEAD_GROUP at a time (the first group holds the
    remainder, so that the last one is whole) and, within a group, one tile of every head before
    the next tile. The programs that start last are then a whole group's, its tiles that see the
    most blocks (causal: the last query tiles, the first KV tiles) first: the kernel's tail is not
    one head's longest tile started late. A group's heads' tensors are few enough to stay in L2
    (kernels/hopper.py: head_group). HEAD_GROUP 1 is the grid's own order."""
    lead = n_bh % HEAD_GROUP  # the first group's heads
    rest = lin - lead * n_tiles
    group = gl.maximum(rest, 0) // (HEAD_GROUP * n_tiles)
    first = gl.where(rest < 0, 0, lead + group * HEAD_GROUP)
    heads = gl.where(rest < 0, lead, HEAD_GROUP)
    r = gl.where(rest < 0, lin, rest - group * HEAD_GROUP * n_tiles)
    return r // heads, first + r % heads
