"""A paged KV cache: K/V live in fixed-size pages shared by all sequences, one page table each.

`PagedKVCache` keeps one physical K and V buffer, ``[1, H, n_pages * page_size, E]``, and for
each batch slot a page table (logical page -> physical page) and its inverse. Attention runs on
the physical buffers (batch 1, broadcast over the query batch) with a BlockMask and mods that
were written for logical positions and converted here:

    cache = PagedKVCache(n_pages=64, page_size=128, max_batch_size=4, num_heads=8, head_dim=64)
    cache.reserve(0, 1000); cache.reserve(1, 300)                 # host: assign pages
    cache.assign(batch_idx, input_pos, k_new, v_new)              # device: write new tokens
    bm = cache.convert_logical_block_mask(logical_block_mask)     # kv_indices -> physical pages
    out = decode_attention(q, cache.k_cache, cache.v_cache, mask_mod=cache.get_mask_mod(causal),
                           block_mask=bm)

`reserve`/`erase` decide page ownership on the host (between steps, like a serving scheduler);
`assign`, the converted BlockMask and the converted mods only read device tensors that
`reserve`/`erase` update in place, so a decode step that uses them can be captured in a CUDA graph.
The converted mods read ``physical_to_logical`` in-kernel: a KV position on a page that the
sequence does not own is masked out (a converted score_mod gives it -inf, as torch's), and so is
one at or past the logical mask's KV length or ``kv_len[b]`` (torch's argument): the rest of a
partly filled last page. Likewise `assign` drops a write to a position its slot does
not own (it lands on a scratch page past the cache) instead of checking on the host.
"""

from __future__ import annotations

import torch

from flexattn import ir
from flexattn.block_mask import as_mod, noop_mask
from flexattn.mods import MASK, SCORE, Mod


def _listed(num: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Which entries of each row of ``idx`` its count ``num`` lists."""
    return torch.arange(idx.shape[-1], device=idx.device) < num[..., None].long()


def _packed(entries: torch.Tensor, keep: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(count, list) of the ``keep`` entries of each row, first and in their order (a stable sort
    of a 0/1 key), ``width`` entries a row; past the count, entries are left as they fall."""
    order = torch.argsort((~keep).to(torch.int8), dim=-1, stable=True)
    return keep.sum(-1).to(torch.int32), torch.gather(entries, -1, order)[..., :width]


def _partial_where(num, idx, full_num, full_idx, block: int | None) -> tuple:
    """The (partial, full) block lists with the full entries of KV block ``block`` (None: every
    full entry) moved to the partial list, after its own entries; each list stays packed."""
    shape = torch.broadcast_shapes(num.shape, full_num.shape)
    num, full_num = num.expand(shape), full_num.expand(shape)
    idx, full_idx = idx.expand(*shape, -1).long(), full_idx.expand(*shape, -1).long()
    full_listed = _listed(full_num, full_idx)
    move = full_listed if block is None else full_listed & (full_idx == block)
    width = max(idx.shape[-1], full_idx.shape[-1])  # (a row lists each KV block once)
    num, idx = _packed(torch.cat([idx, full_idx], -1), torch.cat([_listed(num, idx), move], -1), width)
    full_num, full_idx = _packed(full_idx, full_listed & ~move, width)
    return num, idx.to(torch.int32), full_num, full_idx.to(torch.int32)


class PagedKVCache:
    """Physical K/V pages plus per-sequence page tables (torch's experimental PagedAttention API).

    Example:
        >>> cache = PagedKVCache(n_pages=8, page_size=16, max_batch_size=2, num_heads=2, head_dim=32)
        >>> cache.reserve(0, 40)            # sequence 0 owns 3 pages
        >>> cache.page_table[0, :3].tolist() != [-1, -1, -1]
        True
    """

    def __init__(self, n_pages: int, page_size: int, max_batch_size: int, num_heads: int, head_dim: int,
                 v_head_dim: int | None = None, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        for name, v in (("n_pages", n_pages), ("page_size", page_size), ("max_batch_size", max_batch_size),
                        ("num_heads", num_heads), ("head_dim", head_dim)):
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        self.n_pages, self.page_size, self.max_batch_size = n_pages, page_size, max_batch_size
        device = torch.device(device)
        length = n_pages * page_size
        # One scratch page past the cache takes writes to unowned positions (see `assign`); the
        # caches attention reads are views without it.
        store = (n_pages + 1) * page_size
        self._k_store = torch.zeros(1, num_heads, store, head_dim, dtype=dtype, device=device)
        self._v_store = torch.zeros(1, num_heads, store, v_head_dim or head_dim, dtype=dtype, device=device)
        self.k_cache = self._k_store[:, :, :length]
        self.v_cache = self._v_store[:, :, :length]
        # page_table[b, logical page] = physical page; physical_to_logical[b, physical page] = logical page.
        self.page_table = torch.full((max_batch_size, n_pages), -1, dtype=torch.int32, device=device)
        self.physical_to_logical = torch.full((max_batch_size, n_pages), -1, dtype=torch.int32, device=device)
        self.capacity = [0] * max_batch_size          # pages owned, per slot (host)
        self.empty_pages = list(range(n_pages - 1, -1, -1))
        self._slots = torch.arange(max_batch_size, dtype=torch.int32, device=device)

    # -- page ownership (host)

    def _check_slot(self, batch_idx: int) -> None:
        if not isinstance(batch_idx, int) or not 0 <= batch_idx < self.max_batch_size:
            raise ValueError(f"batch_idx must be an int in [0, {self.max_batch_size}), got {batch_idx!r}")

    def reserve(self, batch_idx: int, seq_len: int) -> None:
        """Give slot ``batch_idx`` enough pages for ``seq_len`` tokens (pages it has are kept)."""
        self._check_slot(batch_idx)
        need = -(-seq_len // self.page_size) - self.capacity[batch_idx]
        if need <= 0:
            return
        if need > len(self.empty_pages):
            raise RuntimeError(f"PagedKVCache is out of pages: slot {batch_idx} needs {need} more for "
                               f"{seq_len} tokens, {len(self.empty_pages)} free of {self.n_pages}")
        first = self.capacity[batch_idx]
        pages = [self.empty_pages.pop() for _ in range(need)]
        phys = torch.tensor(pages, dtype=torch.int32)
        logical = torch.arange(first, first + need, dtype=torch.int32)
        self.page_table[batch_idx, first:first + need] = phys.to(self.page_table.device)
        self.physical_to_logical[batch_idx, phys.long()] = logical.to(self.page_table.device)
        self.capacity[batch_idx] += need

    def erase(self, batch_idx: int) -> None:
        """Free every page of slot ``batch_idx``."""
        self._check_slot(batch_idx)
        n = self.capacity[batch_idx]
        pages = self.page_table[batch_idx, :n].tolist()
        self.empty_pages.extend(reversed(pages))
        self.page_table[batch_idx, :n] = -1
        self.physical_to_logical[batch_idx].fill_(-1)
        self.capacity[batch_idx] = 0

    # -- writing tokens (device only)

    def physical_positions(self, batch_idx: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        """Physical cache position of logical position ``input_pos[i, s]`` of slot ``batch_idx[i]``,
        or -1 where the slot does not own it (unreserved page, negative or past the page table).

            >>> cache = PagedKVCache(n_pages=4, page_size=16, max_batch_size=1, num_heads=1, head_dim=16)
            >>> cache.reserve(0, 20)
            >>> cache.physical_positions(torch.tensor([0]), torch.tensor([[17, 40]])).tolist()
            [[17, -1]]
        """
        pos = input_pos.long()
        logical_page = pos.div(self.page_size, rounding_mode="floor")
        in_table = (logical_page >= 0) & (logical_page < self.n_pages)
        # Clamp before indexing (an index past the table would fault); unowned entries are -1.
        page = self.page_table[batch_idx.long()[:, None], logical_page.clamp(0, self.n_pages - 1)].long()
        owned = in_table & (page >= 0)
        return torch.where(owned, page * self.page_size + pos % self.page_size, -1)

    def assign(self, batch_idx: torch.Tensor, input_pos: torch.Tensor, k_val: torch.Tensor,
               v_val: torch.Tensor, check: bool = False) -> None:
        """Write ``k_val``/``v_val`` [B, H, S, E] at logical positions ``input_pos`` [B, S] of slots ``batch_idx`` [B].

        The slots should own those positions (`reserve` first). A write to a position the slot
        does not own is dropped (it goes to a scratch page that attention never reads), so a
        stale position cannot overwrite another sequence's page. No host synchronisation, so it
        can be captured in a CUDA graph; ``check=True`` adds ``torch._assert_async`` that every
        position is owned (on CUDA that reports late and leaves the context unusable: debugging).
        """
        if k_val.dim() != 4 or k_val.shape[1] != self.k_cache.shape[1] or k_val.shape[3] != self.k_cache.shape[3]:
            raise ValueError(f"k_val must be [B, {self.k_cache.shape[1]}, S, {self.k_cache.shape[3]}], "
                             f"got {tuple(k_val.shape)}")
        if v_val.shape[:3] != k_val.shape[:3] or v_val.shape[3] != self.v_cache.shape[3]:
            raise ValueError(f"v_val must be [B, H, S, {self.v_cache.shape[3]}] like k_val, got {tuple(v_val.shape)}")
        if input_pos.shape != (k_val.shape[0], k_val.shape[2]):
            raise ValueError(f"input_pos must be [B, S] = {(k_val.shape[0], k_val.shape[2])}, got {tuple(input_pos.shape)}")
        if batch_idx.shape != (k_val.shape[0],):
            raise ValueError(f"batch_idx must be [B] = ({k_val.shape[0]},), got {tuple(batch_idx.shape)}")
        addr = self.physical_positions(batch_idx, input_pos).flatten()
        if check:
            torch._assert_async((addr >= 0).all(), "PagedKVCache.assign: a position is not owned by its "
                                "slot; reserve() it first")
        addr = torch.where(addr >= 0, addr, self.n_pages * self.page_size)  # the scratch page
        H = k_val.shape[1]
        self._k_store[0][:, addr] = k_val.transpose(0, 1).reshape(H, -1, k_val.shape[3]).to(self.k_cache.dtype)
        self._v_store[0][:, addr] = v_val.transpose(0, 1).reshape(H, -1, v_val.shape[3]).to(self.v_cache.dtype)

    # -- logical -> physical attention inputs

    def convert_logical_block_mask(self, block_mask, batch_idx: torch.Tensor | None = None,
                                   kv_len: torch.Tensor | None = None):
        """The BlockMask over physical pages that ``block_mask`` (over logical positions) means.

        The KV block size must equal ``page_size``. Query batch b uses slot ``batch_idx[b]``
        (default: b, as torch's: a ``block_mask`` of batch 1 then reads slot 0's pages, for
        every query batch it is broadcast over). The result's mask_mod is ``block_mask``'s own
        (Python or `Mod`) converted with `get_mask_mod`, so the partial tiles stay masked.
        Logical positions at or past the logical mask's KV length (the rest of a partly filled
        last page) and, with ``kv_len`` [B] (torch's argument), at or past ``kv_len[b]`` are
        masked out.
        """
        size = block_mask.BLOCK_SIZE
        q_bs, kv_bs = (size, size) if isinstance(size, int) else tuple(size)
        if kv_bs != self.page_size:
            raise ValueError(f"block_mask KV block size ({kv_bs}) must equal page_size ({self.page_size})")
        num, idx = block_mask.kv_num_blocks, block_mask.kv_indices
        B = num.shape[0] if batch_idx is None else batch_idx.shape[0]
        slots = (self._slots[:B] if batch_idx is None else batch_idx).long()

        def convert(n, i):
            if n is None:
                return None, None
            n = n.expand(B, *n.shape[1:])
            i = i.expand(B, *i.shape[1:])
            table = self.page_table[slots]                                       # [B, n_pages]
            phys = torch.gather(table[:, None, None, :].expand(*i.shape[:3], -1), 3, i.long())
            # A listed logical block the slot does not own (page -1) is dropped, not sent to a
            # page that exists (page 0 would be read twice, or another sequence's page read
            # unmasked in a full block): the owned entries move to the front, in their order.
            count, phys = _packed(phys, _listed(n, i) & (phys >= 0), i.shape[3])
            out = torch.zeros(*i.shape[:3], self.n_pages, dtype=torch.int32, device=i.device)
            out[..., : i.shape[3]] = phys.clamp_min(0)
            return count, out

        full_num, full_idx = block_mask.full_kv_num_blocks, block_mask.full_kv_indices
        seq = getattr(block_mask, "seq_lengths", None)
        if full_num is not None:
            # A full block skips the mask_mod, where the bounds below are checked: with kv_len every
            # full block becomes partial, else the one that crosses the logical KV length (torch's
            # create_block_mask calls the block past the length full where the mask keeps it).
            crossing = None if seq is None or seq[1] % kv_bs == 0 else seq[1] // kv_bs
            if kv_len is not None or crossing is not None:
                num, idx, full_num, full_idx = _partial_where(
                    num, idx, full_num, full_idx, None if kv_len is not None else crossing)
        num, idx = convert(num, idx)
        full_num, full_idx = convert(full_num, full_idx)
        own = getattr(block_mask, "mod", None)  # flexattn's BlockMask keeps its mask_mod traced
        if not isinstance(own, Mod):
            own = as_mod(getattr(block_mask, "mask_mod", None) or noop_mask, MASK, "block_mask.mask_mod")
        if seq is not None:  # (the logical KV length bounds the logical positions, as kv_len does)
            bound = torch.full((B,), int(seq[1]), dtype=torch.int64, device=self.page_table.device)
            kv_len = bound if kv_len is None else torch.minimum(kv_len.to(bound.device, torch.int64), bound)
        mask_mod = self.get_mask_mod(own, batch_idx, kv_len=kv_len)
        seq = (seq[0], self.n_pages * self.page_size) if seq is not None else None
        return type(block_mask).from_kv_blocks(num, idx, full_num, full_idx, BLOCK_SIZE=(q_bs, kv_bs),
                                               mask_mod=mask_mod, seq_lengths=seq)

    def _logical_kv(self, n_buffers: int, batch_idx: torch.Tensor | None, kv_len: torch.Tensor | None = None):
        """IR for (logical kv_idx, owned?) of the physical kv_idx, plus the tensors it reads;
        with ``kv_len`` [B], owned also needs logical kv_idx < kv_len[b]."""
        slots = self._slots if batch_idx is None else batch_idx
        p2l = ir.Buffer(n_buffers, "physical_to_logical", torch.int32, 2)
        slot = ir.Buffer(n_buffers + 1, "slots", slots.dtype, 1)
        kv = ir.input_("kv_idx")
        page = ir.binary("floordiv", kv, self.page_size)
        logical_page = ir.load(p2l, [ir.load(slot, [ir.input_("b")]), page])
        logical = ir.binary("add", ir.binary("mul", logical_page, self.page_size),
                            ir.binary("mod", kv, self.page_size))
        owned = ir.binary("ge", logical_page, 0)
        tensors = [self.physical_to_logical, slots]
        if kv_len is not None:
            if not isinstance(kv_len, torch.Tensor) or kv_len.dim() != 1 or kv_len.dtype.is_floating_point \
                    or kv_len.dtype == torch.bool:
                raise ValueError(f"kv_len must be a 1-d integer tensor [B], got {kv_len!r}")
            length = ir.Buffer(n_buffers + 2, "kv_len", kv_len.dtype, 1)
            owned = ir.binary("and_", owned, ir.binary("lt", logical, ir.load(length, [ir.input_("b")])))
            tensors.append(kv_len)
        return logical, owned, tensors

    def get_mask_mod(self, mask_mod, batch_idx: torch.Tensor | None = None, *,
                     kv_len: torch.Tensor | None = None) -> Mod:
        """``mask_mod`` (a `Mod`, a Python mask_mod or None) over physical positions: also False
        on pages the sequence does not own and, with ``kv_len`` [B] (torch's upper bound), at
        logical positions ``>= kv_len[b]``."""
        if mask_mod is not None:
            mask_mod = as_mod(mask_mod, MASK, "mask_mod")
            if mask_mod.ir.op == "const" and mask_mod.ir.arg is True:
                mask_mod = None  # noop_mask: ownership alone
        base = mask_mod.buffers if mask_mod is not None else ()
        logical, owned, extra = self._logical_kv(len(base), batch_idx, kv_len)
        if mask_mod is None:
            return Mod(MASK, owned, extra, name="paged_owned")
        body = ir.substitute(mask_mod.ir, lambda n: logical if n.op == "input" and n.arg == "kv_idx" else None)
        return Mod(MASK, ir.binary("and_", owned, body), list(base) + extra, name=f"paged_{mask_mod.name}")

    def get_score_mod(self, score_mod, batch_idx: torch.Tensor | None = None, *,
                      kv_len: torch.Tensor | None = None) -> Mod | None:
        """``score_mod`` (a `Mod`, a Python score_mod or None) called with logical kv_idx; as
        torch's, the score is -inf on pages the sequence does not own (and, with ``kv_len`` [B],
        at logical positions ``>= kv_len[b]``), so that it masks them without a mask_mod (a dense
        walk over the whole cache)."""
        if score_mod is None:
            return None
        score_mod = as_mod(score_mod, SCORE, "score_mod")
        logical, owned, extra = self._logical_kv(len(score_mod.buffers), batch_idx, kv_len)
        body = ir.substitute(score_mod.ir, lambda n: logical if n.op == "input" and n.arg == "kv_idx" else None)
        body = ir.where(owned, body, float("-inf"))
        return Mod(SCORE, body, list(score_mod.buffers) + extra, name=f"paged_{score_mod.name}")
