"""Training-attention benchmark, forward and backward: flexattn vs torch.compile(flex_attention) vs SDPA.

    python benchmarks/bench_attention.py                         # B=4, H=16, D=128, S=8192, bf16, GPU
    python benchmarks/bench_attention.py --seq 2048 --batch 1    # smaller
    python benchmarks/bench_attention.py --device cpu            # tiny shape, flexattn only (interpreter)

Cases: no mask, causal, sliding window 1024 (causal), alibi + causal, tanh softcap, 16 documents
(packed sequences of uneven lengths, causal inside each document). All
competitors run in one process on the same tensors and print one table, with each one's output
and gradients compared to flexattn's (max|diff|, grad diff: the largest of dQ, dK, dV). TFLOP/s counts
4·B·H·S·S·D for the forward and 2.5x that for the backward, times the fraction of tiles the block
mask visits (so a causal run is credited about half the work of a dense one). SDPA runs where it
can express the case (no mask, causal).

``--rounds N`` times every competitor N times, taking turns (flexattn, torch, SDPA, flexattn, ...),
and prints each one's median: a shared host drifts by tens of percent within a minute, and a short
call (S=2k) can be bound by the host, so one timing per competitor reads whichever drift it met.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import triton

import flexattn
from timing import timer  # benchmarks/timing.py (scripts run from any directory)


def document_ids(S: int, docs: int, device: str) -> torch.Tensor:
    """[S] int32 document id of each position: `docs` documents of uneven, seeded lengths."""
    g = torch.Generator().manual_seed(docs)
    weights = torch.rand(docs, generator=g) + 0.25
    bounds = (weights.cumsum(0) / weights.sum() * S).round().long()
    return torch.bucketize(torch.arange(S), bounds, right=True).clamp_max(docs - 1).to(torch.int32).to(device)


def cases(H: int, S: int, window: int, docs: int, device: str):
    """name -> (score_mod or None, mask_mod or None, SDPA is_causal or None when SDPA cannot)."""
    slopes = torch.exp2(-8.0 * (torch.arange(H, dtype=torch.float32, device=device) + 1) / H)
    doc = document_ids(S, docs, device)

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def sliding_window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < window)

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    def softcap(score, b, h, q_idx, kv_idx):
        return 30.0 * torch.tanh(score / 30.0)

    def documents(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    return {
        "no mask": (None, None, False),
        "causal": (None, causal, True),
        f"sliding window {window}": (None, sliding_window, None),
        "alibi + causal": (alibi, causal, None),
        "tanh softcap": (softcap, None, None),
        f"{docs} documents": (None, documents, None),
    }


def visited_fraction(block_mask) -> float:
    """Fraction of (query tile, KV tile) pairs a block mask visits (1.0 without one)."""
    if block_mask is None:
        return 1.0
    n = block_mask.kv_num_blocks.sum().item()
    if block_mask.full_kv_num_blocks is not None:
        n += block_mask.full_kv_num_blocks.sum().item()
    b, h, n_q = block_mask.kv_num_blocks.shape
    q_len, kv_len = block_mask.seq_lengths
    q_blk, kv_blk = (block_mask.BLOCK_SIZE if isinstance(block_mask.BLOCK_SIZE, tuple)
                     else (block_mask.BLOCK_SIZE,) * 2)
    return n / (b * h * triton.cdiv(q_len, q_blk) * triton.cdiv(kv_len, kv_blk))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--batch", type=int, default=None, help="B (GPU default 4, CPU 1)")
    p.add_argument("--heads", type=int, default=None, help="H (GPU default 16, CPU 2)")
    p.add_argument("--seq", type=int, default=None, help="S = Q_LEN = KV_LEN (GPU default 8192, CPU 96)")
    p.add_argument("--head-dim", type=int, default=None, help="D (GPU default 128, CPU 32)")
    p.add_argument("--window", type=int, default=None, help="sliding window (GPU default 1024, CPU 32)")
    p.add_argument("--docs", type=int, default=None, help="documents of the document case (GPU 16, CPU 3)")
    p.add_argument("--cases", default=None, help="comma-separated case names (default: all)")
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--rep", type=int, default=None)
    p.add_argument("--rounds", type=int, default=1,
                   help="timings per competitor, interleaved between competitors; the median is printed")
    p.add_argument("--no-torch", action="store_true", help="flexattn only")
    p.add_argument("--no-backward", action="store_true", help="forward only")
    args = p.parse_args(argv)

    device = args.device
    on_gpu = device != "cpu"
    dtype = getattr(torch, args.dtype) if on_gpu else torch.float32
    B = args.batch or (4 if on_gpu else 1)
    H = args.heads or (16 if on_gpu else 2)
    S = args.seq or (8192 if on_gpu else 96)
    D = args.head_dim or (128 if on_gpu else 32)
    window = args.window or (1024 if on_gpu else 32)
    docs = args.docs or (16 if on_gpu else 3)
    warmup = args.warmup if args.warmup is not None else (5 if on_gpu else 0)
    rep = args.rep if args.rep is not None else (20 if on_gpu else 1)
    run_torch = on_gpu and not args.no_torch
    block = 128 if on_gpu else 32

    name = torch.cuda.get_device_name(device) if on_gpu else "CPU (Triton interpreter)"
    print(f"# {name} | torch {torch.__version__} | triton {triton.__version__} | flexattn {flexattn.__version__}")
    print(f"# {args.dtype if on_gpu else 'float32'}, B={B}, H={H}, S={S}, D={D}, block mask BLOCK_SIZE={block}, "
          f"{max(1, args.rounds)} interleaved round(s) of {rep} timed calls (median)")

    if run_torch:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.attention.flex_attention import create_block_mask as torch_block_mask
        from torch.nn.attention.flex_attention import flex_attention as torch_flex

        # Five cases x (grad on/off) recompile flex_attention more than dynamo's default limit of 8;
        # past it dynamo silently falls back to the eager, dense implementation.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        compiled_flex = torch.compile(torch_flex, dynamic=False)

    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(B, H, S, D, device=device, generator=g).to(dtype).requires_grad_() for _ in range(3))
    d_out = torch.randn(B, H, S, D, device=device, generator=g).to(dtype)

    selected = cases(H, S, window, docs, device)
    if args.cases:
        wanted = {c.strip() for c in args.cases.split(",")}
        selected = {k_: v_ for k_, v_ in selected.items() if k_ in wanted}

    rows = []
    for case, (score_mod, mask_mod, sdpa_causal) in selected.items():
        bm = flexattn.create_block_mask(mask_mod, 1, 1, S, S, device=device, BLOCK_SIZE=block) \
            if mask_mod is not None else None
        frac = visited_fraction(bm)
        impls = {"flexattn": lambda bm=bm, sm=score_mod: flexattn.flex_attention(q, k, v, score_mod=sm, block_mask=bm)}
        if run_torch:
            tbm = torch_block_mask(mask_mod, 1, 1, S, S, device=device, BLOCK_SIZE=block) \
                if mask_mod is not None else None
            impls["torch flex (compile)"] = lambda tbm=tbm, sm=score_mod: compiled_flex(q, k, v, score_mod=sm,
                                                                                        block_mask=tbm)
            if sdpa_causal is not None:
                def sdpa(is_causal=sdpa_causal):
                    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]):
                        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
                impls["SDPA (cuDNN/flash)"] = sdpa
        fwd_flops = 4 * B * H * S * S * D * frac
        base = base_grads = None
        checked = {}  # impl -> (max|diff| of the output, of the gradients; backward closure or None)
        for impl, fn in impls.items():
            try:
                with torch.no_grad():
                    out = fn()
                    base = out if base is None else base
                    err = (out.float() - base.float()).abs().max().item()
                grad_err = backward = None
                if not args.no_backward:
                    out = fn()
                    grads = torch.autograd.grad(out, (q, k, v), d_out, retain_graph=True)
                    base_grads = grads if base_grads is None else base_grads
                    grad_err = max((a.float() - b.float()).abs().max().item() for a, b in zip(grads, base_grads))
                    del grads
                    backward = (lambda out=out: torch.autograd.grad(out, (q, k, v), d_out, retain_graph=True))
                checked[impl] = (err, grad_err, backward)
            except Exception as e:  # a competitor that cannot run a case is reported, not fatal
                rows.append((case, impl, frac, None, None, None, None, None, None,
                             f"{type(e).__name__}: {str(e)[:60]}"))
        # Timings: the competitors take turns, round after round (each one's median is printed)
        t_fwds, t_bwds = {impl: [] for impl in checked}, {impl: [] for impl in checked}
        for _ in range(max(1, args.rounds)):
            for impl, (_, _, backward) in list(checked.items()):
                try:
                    with torch.no_grad():
                        t_fwds[impl].append(timer(impls[impl], device, warmup, rep))
                    if backward is not None:
                        t_bwds[impl].append(timer(backward, device, warmup, rep))
                except Exception as e:
                    del checked[impl]
                    rows.append((case, impl, frac, None, None, None, None, None, None,
                                 f"{type(e).__name__}: {str(e)[:60]}"))
        for impl, (err, grad_err, _) in checked.items():
            t_fwd = statistics.median(t_fwds[impl])
            t_bwd = statistics.median(t_bwds[impl]) if t_bwds[impl] else None
            rows.append((case, impl, frac, t_fwd * 1e3, fwd_flops / t_fwd / 1e12,
                         None if t_bwd is None else t_bwd * 1e3,
                         None if t_bwd is None else 2.5 * fwd_flops / t_bwd / 1e12, err, grad_err, ""))
        checked.clear()  # (the saved graphs hold their activations)

    head = (f"{'case':<22} {'impl':<21} {'tiles':>6} {'fwd ms':>9} {'fwd TF/s':>9} {'bwd ms':>9} "
            f"{'bwd TF/s':>9} {'max|diff|':>10} {'grad diff':>10}")
    print(head)
    print("-" * len(head))
    for case, impl, frac, tf, ff, tb, fb, err, grad_err, note in rows:
        if tf is None:
            print(f"{case:<22} {impl:<21} {frac:>6.3f}  n/a  {note}")
            continue
        bwd = f"{tb:>9.3f} {fb:>9.1f}" if tb is not None else f"{'-':>9} {'-':>9}"
        gerr = f"{grad_err:>10.2e}" if grad_err is not None else f"{'-':>10}"
        print(f"{case:<22} {impl:<21} {frac:>6.3f} {tf:>9.3f} {ff:>9.1f} {bwd} {err:>10.2e} {gerr}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
