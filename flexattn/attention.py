"""`flex_attention`: block-sparse attention with compiled score/mask mods.

Same arguments and meaning as ``torch.nn.attention.flex_attention.flex_attention``::

    out = flex_attention(q, k, v, score_mod=softcap, block_mask=mask)
    out, lse = flex_attention(q, k, v, return_lse=True)          # lse: natural log, fp32, [B, Hq, L]
    out, aux = flex_attention(q, k, v, return_aux=AuxRequest(lse=True, max_scores=True))

How a call runs is `flexattn.call`'s business (trace once, one plan lookup, one launch).
"""

from __future__ import annotations

from typing import Callable

import torch

from flexattn.auxiliary import AuxOutput, AuxRequest, check_request
from flexattn.call import attend
from flexattn.mods import Mod


def flex_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   score_mod: Callable | Mod | None = None, block_mask=None, scale: float | None = None,
                   enable_gqa: bool = False, return_lse: bool = False,
                   kernel_options: dict | None = None, *, return_aux: AuxRequest | None = None,
                   descale_q: torch.Tensor | None = None, descale_k: torch.Tensor | None = None,
                   descale_v: torch.Tensor | None = None, sinks: torch.Tensor | None = None):
    """Attention with a score modification and a block-sparse mask, fused into one kernel.

    ``query`` is [B, Hq, Q_LEN, E], ``key`` [B or 1, Hkv, KV_LEN, E], ``value`` [B or 1, Hkv,
    KV_LEN, Ev]; float16, bfloat16, float32 or float64, any strides. ``score_mod(score, b, h,
    q_idx, kv_idx)`` (Python or a DSL `Mod`) rewrites each score, ``block_mask`` (from
    ``create_block_mask``; flexattn's or torch's) says which KV blocks each query block sees and
    carries the mask_mod. ``scale`` defaults to 1/sqrt(E). With GQA (``enable_gqa=True``) query
    head h uses KV head h // (Hq // Hkv).

    Returns ``out`` [B, Hq, Q_LEN, Ev] in query's dtype and stride order; with
    ``return_lse=True`` also the row log-sum-exp (natural log, [B, Hq, Q_LEN], float32; float64
    for float64 inputs, so that gradients can be checked numerically); with
    ``return_aux=AuxRequest(lse=..., max_scores=...)`` ``(out, AuxOutput(...))`` as torch 2.13.
    A query row that sees no key gets output 0, LSE -inf and max score -inf. CPU tensors run the
    same kernel through Triton's interpreter (slow; for tests and small demos).

    float8 (``float8_e4m3fn``) query/key/value run a forward-only kernel: ``descale_q``,
    ``descale_k``, ``descale_v`` (one-element float32 tensors, default 1) are the per-tensor factors
    that dequantise them (FlashAttention-3's convention: attention of ``query * descale_q`` etc.);
    Q K^T and P V run in float8 (P rounded to float8) and the output is bfloat16.

    ``sinks`` ([Hq], float16/bfloat16/float32/float64, may require grad; gpt-oss's attention
    sinks): one logit per query head that joins every row's softmax denominator as a term
    ``exp(sinks[h])`` with no value row, inside the kernel. The LSE includes it, a row that sees
    no key gets output 0 and LSE ``sinks[h]``, max_scores ignores it; its gradient is computed in
    the backward. Not with float8 inputs.

    >>> q, k, v = (torch.randn(1, 2, 40, 16) for _ in range(3))
    >>> soft = lambda score, b, h, q_idx, kv_idx: 20 * torch.tanh(score / 20)
    >>> flex_attention(q, k, v, score_mod=soft).shape
    torch.Size([1, 2, 40, 16])
    """
    check_request(return_aux, return_lse)
    want_max = return_aux is not None and return_aux.max_scores
    descale = None if descale_q is None and descale_k is None and descale_v is None else \
        (descale_q, descale_k, descale_v)
    want_lse = return_lse or (return_aux is not None and bool(return_aux.lse))
    out, lse, mx = attend(query, key, value, score_mod, block_mask, scale, enable_gqa, kernel_options,
                          want_max, None, descale=descale, want_lse=want_lse, sinks=sinks)
    if return_aux is not None:
        return out, AuxOutput(lse=lse if return_aux.lse else None, max_scores=mx)
    return (out, lse) if return_lse else out
