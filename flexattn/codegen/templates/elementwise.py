# Evaluate one mod over a [B, H, Q_LEN, KV_LEN] grid: the kernel tests use this to compare the
# generated Triton code with the eager evaluator, element by element.
#
# sub notation:
#   BLOCK_M, BLOCK_N: tile of (q_idx, kv_idx) one program evaluates
#   IS_SCORE: the mod is a score mod (reads Score) rather than a mask mod
$prelude

$mod_def


@triton.jit
def elementwise_kernel(
    Out, Score, $mod_params
    stride_sb, stride_sh, stride_sm, stride_sn,
    stride_ob, stride_oh, stride_om, stride_on,
    H, Q_LEN, KV_LEN,
    IS_SCORE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_bh = tl.program_id(2)
    b = pid_bh // H
    h = pid_bh % H
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    q_idx = offs_m[:, None]
    kv_idx = offs_n[None, :]
    inside = (q_idx < Q_LEN) & (kv_idx < KV_LEN)
    if IS_SCORE:
        score = tl.load(Score + b * stride_sb + h * stride_sh + q_idx * stride_sm + kv_idx * stride_sn,
                        mask=inside, other=0.0)
        out = $mod_call
    else:
        out = tl.broadcast_to($mod_call, (BLOCK_M, BLOCK_N))
    tl.store(Out + b * stride_ob + h * stride_oh + q_idx * stride_om + kv_idx * stride_on, out, mask=inside)
