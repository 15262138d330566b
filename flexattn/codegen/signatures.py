"""Each launched kernel's parameter list, declared once.

A template writes ``def <kernel>(\n$<kernel>_params\n):`` and `render` fills that hook from the
declaration here; the host builds the kernel's argument tuple group by group in the same order
(``kernels/forward.py``'s `launch_args`, ...), and tests/test_signatures.py checks both, name by
name, for every kernel. A group is a name and its parameters; `MODS` stands for the hooks that
list the mods' captured-tensor parameters (pointer, strides, sizes of each), which the host's
``launch.buffer_args`` gives in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass

MODS = "mods"  # a group whose parameters are hooks ("score_mod_params", ...) filled by the mods' emitters

_WIDTH = 100  # rendered lines wrap before this column


@dataclass(frozen=True)
class Signature:
    """``groups``: (group name, parameter names) in order; a `MODS` group names hooks instead.
    ``constexprs``: the compile-time parameters, last (the launch passes them by keyword)."""

    kernel: str
    groups: tuple[tuple[str, tuple[str, ...]], ...]
    constexprs: tuple[str, ...]
    constexpr_type: str = "tl.constexpr"  # "gl.constexpr" in Gluon templates

    def group(self, name: str) -> tuple[str, ...]:
        """The parameters of group ``name``."""
        for group, params in self.groups:
            if group == name:
                return params
        raise KeyError(f"{self.kernel} has no parameter group {name!r}")

    def hooks(self) -> tuple[str, ...]:
        """The template hooks this declaration reads (the mods' parameter lists)."""
        return tuple(h for group, params in self.groups if group == MODS for h in params)

    def names(self, hooks: dict[str, str]) -> list[str]:
        """Every parameter name in order, the mods' from ``hooks`` (each "name, ...")."""
        out: list[str] = []
        for group, params in self.groups:
            if group == MODS:
                out += [p for h in params for p in _split(hooks[h])]
            else:
                out += params
        return out + list(self.constexprs)

    def render(self, hooks: dict[str, str]) -> str:
        """The ``def`` line's parameter list (without the parentheses), one group per line."""
        lines = []
        for group, params in self.groups:
            if group == MODS:
                text = "".join(hooks[h] for h in params).rstrip()
                if text:
                    lines.append(f"    {text}")
            else:
                lines += _wrapped([f"{p}," for p in params])
        lines += _wrapped([f"{c}: {self.constexpr_type}," for c in self.constexprs])
        return "\n".join(lines)


def _split(param_list: str) -> list[str]:
    return [p.strip() for p in param_list.split(",") if p.strip()]


def _wrapped(items: list[str]) -> list[str]:
    lines, line = [], "   "
    for item in items:
        if len(line) + 1 + len(item) > _WIDTH and line.strip():
            lines.append(line)
            line = "   "
        line += " " + item
    if line.strip():
        lines.append(line)
    return lines


def _names(text: str) -> tuple[str, ...]:
    return tuple(_split(text))


_FORWARD_CONSTEXPRS = _names("""
    BLOCK_M, BLOCK_N, SPARSE_Q_BLOCK_SIZE, SPARSE_KV_BLOCK_SIZE,
    QK_HEAD_DIM, QK_HEAD_DIM_ROUNDED, V_HEAD_DIM, V_HEAD_DIM_ROUNDED, SAFE_HEAD_DIM,
    IS_DIVISIBLE, GQA_SHARED_HEADS, HAS_FULL_BLOCKS, PRESCALE_QK, ROWS_GUARANTEED_SAFE,
    BLOCKS_ARE_CONTIGUOUS, OFFS_INT64, OUTPUT_MAX, IS_FP8, SCORES_IN_BASE2, SCORE_AFFINE, LONGEST_FIRST,
    HAS_SINKS, ACC_DTYPE, SCORE_DTYPE, DOT_PRECISION, DOT_IN_FP64""")

_KV_TABLES = ("tables", _names("KV_NUM_BLKS, KV_IDX, FULL_KV_NUM_BLKS, FULL_KV_IDX"))
_KV_TABLE_STRIDES = ("table_strides", _names("""
    stride_nz, stride_nh, stride_nm, stride_iz, stride_ih, stride_im,
    stride_fnz, stride_fnh, stride_fnm, stride_fiz, stride_fih, stride_fim"""))
_FORWARD_MODS = (MODS, ("score_mod_params", "mask_mod_params"))
_SINKS = ("sinks", ("SINKS",))

FORWARD = Signature("flex_attention_forward", (
    ("tensors", _names("Q, K, V, Out, LSE, MaxScores")),
    ("descale", _names("DESCALE_Q, DESCALE_K, DESCALE_V")),
    _SINKS,
    _KV_TABLES,
    _FORWARD_MODS,
    ("strides", _names("""
        stride_qz, stride_qh, stride_qm, stride_qk, stride_kz, stride_kh, stride_kn, stride_kk,
        stride_vz, stride_vh, stride_vn, stride_vk, stride_oz, stride_oh, stride_om, stride_ok,
        stride_lz, stride_lh""")),
    _KV_TABLE_STRIDES,
    ("sizes", _names("HQ, Q_LEN, KV_LEN")),
    ("scalars", ("SM_SCALE",)),
), _FORWARD_CONSTEXPRS)

FORWARD_HOPPER = Signature("flex_attention_forward", (
    ("tensors", _names("Q, K, V, Out, LSE, MaxScores")),
    ("descale", _names("DESCALE_Q, DESCALE_K, DESCALE_V")),
    _SINKS,
    _KV_TABLES,
    _FORWARD_MODS,
    ("strides", _names("stride_oz, stride_oh, stride_om, stride_lz, stride_lh")),
    _KV_TABLE_STRIDES,
    ("sizes", _names("HQ, Q_LEN, KV_LEN, HEAD_GROUP")),
    ("scalars", ("SM_SCALE",)),
), _names("""
    BLOCK_M, BLOCK_N, SPARSE_Q_BLOCK_SIZE, SPARSE_KV_BLOCK_SIZE,
    GQA_SHARED_HEADS, KV_BATCH_BROADCAST, HAS_FULL_BLOCKS, BLOCKS_ARE_CONTIGUOUS,
    IS_DIVISIBLE, OUTPUT_MAX, SCORES_IN_BASE2, SCORE_AFFINE,
    LONGEST_FIRST, HAS_SINKS, NUM_BUFFERS, CONSUMER_REGS, SCORE_DTYPE, IS_FP8, O_TMA"""), "gl.constexpr")

DECODE_SPLIT = Signature("decode_split_kernel", (
    ("tensors", _names("Q, K, V, Out, LSE, SPLITS_DONE")),
    _SINKS,
    _KV_TABLES,
    ("lengths", ("KV_LENGTHS",)),
    (MODS, ("score_params", "mask_params")),
    ("strides", _names("""
        stride_qz, stride_qh, stride_qm, stride_qk, stride_kz, stride_kh, stride_kn, stride_kk,
        stride_vz, stride_vh, stride_vn, stride_vk""")),
    ("out_strides", _names("stride_oz, stride_oh, stride_om, stride_ok")),
    _KV_TABLE_STRIDES,
    ("sizes", _names("Q_LEN, KV_LEN, QK_HEAD_DIM, V_HEAD_DIM, N_ROWS")),
    ("scalars", ("SM_SCALE",)),
), _names("""
    HKV, GQA_SHARED_HEADS, PACKED_HEADS, Q_ROWS, NUM_Q_BLOCKS, M_TILES, BLOCK_M, BLOCK_N,
    QK_HEAD_DIM_ROUNDED, V_HEAD_DIM_ROUNDED, SPLIT_KV, TILE_KV, SPARSE_Q_BLOCK_SIZE, SPARSE_KV_BLOCK_SIZE,
    HAS_BLOCK_MASK, HAS_FULL_BLOCKS, APPLY_MASK_DENSE, HAS_KV_LENGTHS, HAS_SINKS, IS_DIVISIBLE_M, IS_DIVISIBLE_N,
    SAFE_HEAD_DIM, DOT_PRECISION, DOT_IN_FP64, MERGE_M, MERGE_CHUNK"""))

_STATE_STRIDES = ("state_strides", _names("stride_sbh, stride_sm"))
_ORDER_CONSTEXPRS = _names("SEPARATE_FULL, SEL, CHUNK, RECTS")

CLASSIFY = Signature("classify_kernel", (
    ("tensors", _names("State, Deferred")),
    (MODS, ("mod_params", "interval_params")),
    _STATE_STRIDES,
    ("sizes", _names("HD, Q_LEN, KV_LEN, N_KV_TILES, N_WORDS, CAP")),
), _names("BLOCK_Q, BLOCK_KV, SUB_Q, SUB_KV, CHUNK_WORDS, USE_INTERVAL, DEFER_MIN"))

EXACT = Signature("exact_kernel", (
    ("tensors", _names("State, Deferred")),
    (MODS, ("mod_params",)),
    _STATE_STRIDES,
    ("sizes", _names("HD, Q_LEN, KV_LEN, CAP")),
), _names("NPROG, BLOCK_Q, BLOCK_KV, SUB_Q, SUB_KV"))

KV_ORDER = Signature("kv_order_kernel", (
    ("tensors", _names("State, KvNum, KvIdx, FullNum, FullIdx, Rects")),
    _STATE_STRIDES,
    ("sizes", _names("N_Q_TILES, N_KV_TILES, Q0, KV0")),
), _ORDER_CONSTEXPRS)

Q_ORDER = Signature("q_order_kernel", (
    ("tensors", _names("State, QNum, QIdx, FullNum, FullIdx, Rects")),
    _STATE_STRIDES,
    ("sizes", _names("N_Q_TILES, N_KV_TILES, Q0, KV0")),
), _ORDER_CONSTEXPRS)

_BACKWARD_CONSTEXPRS = _names("""
    SPARSE_Q_BLOCK_SIZE, SPARSE_KV_BLOCK_SIZE, QK_HEAD_DIM, QK_HEAD_DIM_ROUNDED,
    V_HEAD_DIM, V_HEAD_DIM_ROUNDED, SAFE_HEAD_DIM, IS_DIVISIBLE, GQA_SHARED_HEADS, HAS_FULL_BLOCKS,
    BLOCKS_ARE_CONTIGUOUS, OFFS_INT64, ACC_DTYPE, SCORE_DTYPE, SCORES_IN_BASE2, DOT_PRECISION, DOT_IN_FP64""")
_Q_TABLES = ("tables", _names("Q_NUM_BLKS, Q_IDX, FULL_Q_NUM_BLKS, FULL_Q_IDX"))
_Q_TABLE_STRIDES = ("table_strides", _names("""
    stride_nz, stride_nh, stride_nn, stride_iz, stride_ih, stride_in,
    stride_fnz, stride_fnh, stride_fnn, stride_fiz, stride_fih, stride_fin"""))
_QKV_STRIDES = _names("""
    stride_qz, stride_qh, stride_qm, stride_qk, stride_kz, stride_kh, stride_kn, stride_kk,
    stride_vz, stride_vh, stride_vn, stride_vk""")
_DO_LSE_STRIDES = _names("stride_doz, stride_doh, stride_dom, stride_dok, stride_lz, stride_lh, stride_lm")

BACKWARD_PREPROCESS = Signature("backward_preprocess", (
    ("tensors", _names("Out, DO, DLSE, DELTA, DQ_ACC")),
    ("strides", _names("""
        stride_oz, stride_oh, stride_om, stride_ok, stride_doz, stride_doh, stride_dom, stride_dok,
        stride_dlz, stride_dlh, stride_dlm""")),
    ("dq_strides", _names("stride_dqz, stride_dqh, stride_dqm")),
    ("sizes", _names("HQ, Q_LEN")),
), _names("""
    BLOCK_M, V_HEAD_DIM, V_HEAD_DIM_ROUNDED, QK_HEAD_DIM, QK_HEAD_DIM_ROUNDED, HAS_GRAD_LSE, ZERO_DQ,
    ACC_DTYPE"""))

BACKWARD_DKDV = Signature("backward_dkdv", (
    ("tensors", _names("Q, K, V, DO, LSE, DELTA, DK, DV")),
    _Q_TABLES,
    _FORWARD_MODS,
    ("qkv_strides", _QKV_STRIDES),
    ("strides", _DO_LSE_STRIDES + _names("""
        stride_dkz, stride_dkh, stride_dkn, stride_dkk, stride_dvz, stride_dvh, stride_dvn, stride_dvk""")),
    _Q_TABLE_STRIDES,
    ("sizes", _names("HQ, HKV, Q_LEN, KV_LEN")),
    ("scalars", ("SM_SCALE",)),
), ("BLOCK_M1", "BLOCK_N1") + _BACKWARD_CONSTEXPRS)

BACKWARD_DQ = Signature("backward_dq", (
    ("tensors", _names("Q, K, V, DO, LSE, DELTA, DQ")),
    _KV_TABLES,
    (MODS, ("score_mod_params", "mask_mod_params", "grad_params")),
    ("qkv_strides", _QKV_STRIDES),
    ("strides", _DO_LSE_STRIDES + _names("stride_dqz, stride_dqh, stride_dqm, stride_dqk")),
    _KV_TABLE_STRIDES,
    ("sizes", _names("HQ, Q_LEN, KV_LEN")),
    ("scalars", ("SM_SCALE",)),
), ("BLOCK_M2", "BLOCK_N2") + _BACKWARD_CONSTEXPRS)

BACKWARD_HOPPER = Signature("flex_attention_backward", (
    # Q, K, V, DO and DQ_DESC (the float32 dQ accumulator) are TMA descriptors; DK and DV too with DKV_TMA;
    # DQ_SEM: the int32 counts of DQ_ORDERED's adds (one per dQ tile; read only with DQ_ORDERED)
    ("tensors", _names("Q, K, V, DO, DQ_DESC, DQ_SEM, LSE, DELTA, DK, DV")),
    _Q_TABLES,
    _FORWARD_MODS,
    ("strides", _names("""
        stride_lz, stride_lh, stride_lm, stride_dkz, stride_dkh, stride_dkn, stride_dvz, stride_dvh, stride_dvn""")),
    _Q_TABLE_STRIDES,
    ("sizes", _names("HQ, HKV, Q_LEN, KV_LEN, BATCH, HEAD_GROUP")),
    ("scalars", ("SM_SCALE",)),
), _names("""
    BLOCK_M, BLOCK_N, SPARSE_Q_BLOCK_SIZE, SPARSE_KV_BLOCK_SIZE,
    GQA_SHARED_HEADS, KV_BATCH_BROADCAST, HAS_FULL_BLOCKS, BLOCKS_ARE_CONTIGUOUS, IS_DIVISIBLE, SCORES_IN_BASE2,
    SCORE_AFFINE, LATE_DP_WAIT, NUM_BUFFERS, CONSUMER_REGS, SCORE_DTYPE, DEFER_DQ, DKV_TMA, COMPUTE_DQ,
    PERSISTENT, DQ_ORDERED"""), "gl.constexpr")

BACKWARD_DQ_HOPPER = Signature("flex_attention_backward_dq", (
    # Q, K, V, DO and DQ (16-bit, written once) are TMA descriptors; the pass writes DELTA from OUT,
    # DO and DLSE
    ("tensors", _names("Q, K, V, DO, DQ, LSE, DELTA, OUT, DLSE")),
    _KV_TABLES,
    _FORWARD_MODS,
    ("strides", _names("""
        stride_lz, stride_lh, stride_lm, stride_oz, stride_oh, stride_om, stride_ok,
        stride_dlz, stride_dlh, stride_dlm""")),
    _KV_TABLE_STRIDES,
    ("sizes", _names("HQ, Q_LEN, KV_LEN, BATCH, HEAD_GROUP")),
    ("scalars", ("SM_SCALE",)),
), _names("""
    BLOCK_M, BLOCK_N, SPARSE_Q_BLOCK_SIZE, SPARSE_KV_BLOCK_SIZE, GQA_SHARED_HEADS, KV_BATCH_BROADCAST,
    HAS_FULL_BLOCKS, BLOCKS_ARE_CONTIGUOUS, IS_DIVISIBLE, SCORES_IN_BASE2, HAS_GRAD_LSE, NUM_BUFFERS,
    CONSUMER_REGS, SCORE_DTYPE, PERSISTENT"""), "gl.constexpr")

# template -> the signatures of the kernels it defines (each filled through its $<kernel>_params hook)
TEMPLATES: dict[str, tuple[Signature, ...]] = {
    "forward": (FORWARD,),
    "forward_hopper": (FORWARD_HOPPER,),
    "decode": (DECODE_SPLIT,),
    "block_mask": (CLASSIFY, EXACT, KV_ORDER, Q_ORDER),
    "backward": (BACKWARD_PREPROCESS, BACKWARD_DKDV, BACKWARD_DQ),
    "backward_hopper": (BACKWARD_HOPPER,),
    "backward_dq_hopper": (BACKWARD_DQ_HOPPER,),
}


def param_hooks(template: str, hooks: dict[str, str]) -> dict[str, str]:
    """The ``<kernel>_params`` hooks of ``template``'s declared kernels, from the other ``hooks``."""
    return {f"{sig.kernel}_params": sig.render(hooks) for sig in TEMPLATES.get(template, ())}
