"""`AuxRequest` / `AuxOutput`: the auxiliary outputs of ``flex_attention`` (torch 2.13's API).

(The module is not called ``aux``: AUX is a reserved file name on Windows.)

    out, aux = flex_attention(q, k, v, return_aux=AuxRequest(lse=True, max_scores=True))
    aux.lse, aux.max_scores        # both [B, Hq, Q_LEN], float32 (float64 for float64 inputs)

Same names, fields and meaning as ``torch.nn.attention.flex_attention.AuxRequest`` /
``AuxOutput`` (NamedTuples there and here, so code that unpacks or compares them works either way).
"""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor


class AuxRequest(NamedTuple):
    """Which auxiliary outputs ``flex_attention(..., return_aux=AuxRequest(...))`` computes.

    ``lse``: the row log-sum-exp of the modified scores; ``max_scores``: their row maximum (see
    `AuxOutput`). With ``return_aux`` given, ``flex_attention`` returns ``(out, AuxOutput)``;
    ``return_lse=True`` still returns ``(out, lse)`` and may not be combined with ``return_aux``.

    Example::

        >>> AuxRequest(lse=True)
        AuxRequest(lse=True, max_scores=False)
    """

    lse: bool = False
    max_scores: bool = False


class AuxOutput(NamedTuple):
    """The auxiliary outputs of ``flex_attention``; a field is None unless it was requested.

    With ``s[b, h, i, j] = score_mod(scale * q[b, h, i] . k[b, h_kv, j], b, h, i, j)`` where the
    block mask keeps (i, j), and ``-inf`` where it does not:

    - ``lse[b, h, i] = log(sum_j exp(s[b, h, i, j]))``, natural log;
    - ``max_scores[b, h, i] = max_j s[b, h, i, j]``: the largest modified, scaled score of the row
      itself (not a log, not log2), the number an online softmax subtracts before ``exp``.

    Both are [B, Hq, Q_LEN], float32 (float64 for float64 inputs); a row that sees no key has
    ``lse = max_scores = -inf``.

    Example::

        >>> AuxOutput().lse is None
        True
    """

    lse: Tensor | None = None
    max_scores: Tensor | None = None


def check_request(return_aux, return_lse: bool) -> None:
    """Raise if ``return_aux`` is not an AuxRequest (flexattn's or torch's) or None, or if it comes
    with ``return_lse=True``."""
    if return_aux is None:
        return
    if not (hasattr(return_aux, "lse") and hasattr(return_aux, "max_scores")):
        raise TypeError(f"return_aux must be an AuxRequest or None, got {type(return_aux).__name__}")
    if return_lse:
        raise ValueError("pass either return_lse=True or return_aux=AuxRequest(lse=True), not both")
