"""The `BlockMask` type (torch's fields and methods; see `flexattn.block_mask`)."""

from __future__ import annotations

import itertools
import math
from typing import Callable

import torch

from flexattn import viz
from flexattn.block_mask.mask_mods import as_mod, noop_mask, _sliced_mask_mod_error
from flexattn.block_mask.sizes import _DEFAULT_SPARSE_BLOCK_SIZE, _check_positive, _seq_pair
from flexattn.kernels.tables import (block_size_pair, check_against, flags, ordered, tables_of, tile_states, transpose,
                                     validate_block_tables)
from flexattn.mods import Mod


class BlockMask:
    """Block-sparse attention mask in torch's format (see the module docstring).

    Example::

        >>> bm = create_block_mask(lambda b, h, q, kv: q >= kv, None, None, 300, 300, "cpu", 128)
        >>> bm.kv_num_blocks.tolist(), bm.full_kv_num_blocks.tolist()  # the last row is cut at 300
        ([[[1, 1, 3]]], [[[0, 1, 0]]])
    """

    def __init__(self, seq_lengths: tuple[int, int], kv_num_blocks: torch.Tensor, kv_indices: torch.Tensor,
                 full_kv_num_blocks: torch.Tensor | None, full_kv_indices: torch.Tensor | None,
                 q_num_blocks: torch.Tensor | None, q_indices: torch.Tensor | None,
                 full_q_num_blocks: torch.Tensor | None, full_q_indices: torch.Tensor | None,
                 BLOCK_SIZE: int | tuple[int, int] = (_DEFAULT_SPARSE_BLOCK_SIZE, _DEFAULT_SPARSE_BLOCK_SIZE),
                 mask_mod: Callable = noop_mask, *, dq_write_order: torch.Tensor | None = None,
                 dq_write_order_full: torch.Tensor | None = None, dq_kv_order: torch.Tensor | None = None,
                 dq_kv_order_spt: bool | None = None, validate: bool = True):
        # The kernels follow these tables without bounds checks: check them once, here
        # (``validate=False`` only for tables this module built itself).
        if validate:
            validate_block_tables(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices,
                                  q_num_blocks, q_indices, full_q_num_blocks, full_q_indices,
                                  seq_lengths=_seq_pair(seq_lengths), BLOCK_SIZE=BLOCK_SIZE)
        self.seq_lengths = tuple(seq_lengths)
        self.kv_num_blocks = kv_num_blocks
        self.kv_indices = kv_indices
        self.full_kv_num_blocks = full_kv_num_blocks
        self.full_kv_indices = full_kv_indices
        self.q_num_blocks = q_num_blocks
        self.q_indices = q_indices
        self.full_q_num_blocks = full_q_num_blocks
        self.full_q_indices = full_q_indices
        # torch 2.13's deterministic-dQ metadata for its FLASH backward: carried so that as_tuple()
        # and torch's flex_attention see torch's fields; flexattn's dQ pass (one program per query
        # tile, no atomics) is deterministic without it.
        if dq_write_order_full is not None and dq_write_order is None:
            raise ValueError("dq_write_order_full requires dq_write_order")
        self.dq_write_order = dq_write_order
        self.dq_write_order_full = dq_write_order_full
        self.dq_kv_order = dq_kv_order
        self.dq_kv_order_spt = dq_kv_order_spt
        self.BLOCK_SIZE = block_size_pair(BLOCK_SIZE)
        self.mask_mod = mask_mod

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def from_kv_blocks(cls, kv_num_blocks: torch.Tensor, kv_indices: torch.Tensor,
                       full_kv_num_blocks: torch.Tensor | None = None,
                       full_kv_indices: torch.Tensor | None = None,
                       BLOCK_SIZE: int | tuple[int, int] = _DEFAULT_SPARSE_BLOCK_SIZE,
                       mask_mod: Callable | None = None, seq_lengths: tuple[int, int] | None = None,
                       compute_q_blocks: bool = True, *, dq_write_order: torch.Tensor | None = None,
                       dq_write_order_full: torch.Tensor | None = None,
                       dq_kv_order: torch.Tensor | bool | None = None) -> "BlockMask":
        """A BlockMask from the forward tables; the transposed q_* tables are derived on device.
        ``dq_write_order``, ``dq_write_order_full``, ``dq_kv_order``: torch's metadata for its
        deterministic backward, kept as given (a bool ``dq_kv_order``, torch's "make it", makes
        nothing: flexattn's deterministic mode needs none of them).

        Example::

            >>> nb = torch.tensor([[[1, 2]]], dtype=torch.int32)
            >>> idx = torch.tensor([[[[0, 1], [0, 1]]]], dtype=torch.int32)
            >>> BlockMask.from_kv_blocks(nb, idx, BLOCK_SIZE=16).q_num_blocks.tolist()
            [[[2, 1]]]
        """
        block = block_size_pair(BLOCK_SIZE)
        if seq_lengths is None:
            if not isinstance(kv_indices, torch.Tensor) or kv_indices.dim() < 2:
                # no lengths to default to: let the table checks say what is wrong with kv_indices
                validate_block_tables(kv_num_blocks, kv_indices, seq_lengths=(1, 1), BLOCK_SIZE=block)
            seq_lengths = (kv_indices.shape[-2] * block[0], kv_indices.shape[-1] * block[1])
        seq_lengths = _seq_pair(seq_lengths)
        # Before the transpose, which would follow bad indices too.
        validate_block_tables(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices,
                              seq_lengths=seq_lengths, BLOCK_SIZE=block)
        n_kv = -(-seq_lengths[1] // block[1])  # the q_* tables have a row per KV block
        q_num = q_idx = fq_num = fq_idx = None
        if compute_q_blocks:
            q_num, q_idx = transpose(kv_num_blocks, kv_indices, n_kv)
            if full_kv_num_blocks is not None:
                fq_num, fq_idx = transpose(full_kv_num_blocks, full_kv_indices, n_kv)
        return cls(seq_lengths, kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices,
                   q_num, q_idx, fq_num, fq_idx, BLOCK_SIZE=block,
                   mask_mod=mask_mod if mask_mod is not None else noop_mask, validate=False,
                   dq_write_order=dq_write_order, dq_write_order_full=dq_write_order_full,
                   dq_kv_order=None if isinstance(dq_kv_order, bool) else dq_kv_order)

    # -- views ----------------------------------------------------------------------------------

    def as_tuple(self, flatten: bool = True) -> tuple:
        """torch 2.13's 17 fields, in torch's order (what torch's flex_attention unpacks)::

            Q_LEN, KV_LEN, kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices,
            q_num_blocks, q_indices, full_q_num_blocks, full_q_indices, dq_write_order,
            dq_write_order_full, dq_kv_order, dq_kv_order_spt, Q_BLOCK, KV_BLOCK, mask_mod

        With ``flatten=False`` the lengths and block sizes stay pairs (15 fields).

        Example::

            >>> bm = create_block_mask(lambda b, h, q, kv: q >= kv, None, None, 256, 256, "cpu")
            >>> len(bm.as_tuple()), bm.as_tuple()[:2], bm.as_tuple()[-3:-1]
            (17, (256, 256), (128, 128))
        """
        seq = self.seq_lengths if flatten else (self.seq_lengths,)
        block = self.BLOCK_SIZE if flatten else (self.BLOCK_SIZE,)
        return (*seq, self.kv_num_blocks, self.kv_indices, self.full_kv_num_blocks, self.full_kv_indices,
                self.q_num_blocks, self.q_indices, self.full_q_num_blocks, self.full_q_indices,
                self.dq_write_order, self.dq_write_order_full, self.dq_kv_order, self.dq_kv_order_spt,
                *block, self.mask_mod)

    @classmethod
    def from_torch(cls, block_mask) -> "BlockMask":
        """A flexattn BlockMask with the tables of torch's ``BlockMask`` ``block_mask`` (shared, not copied).

        ``flexattn.flex_attention`` takes torch's BlockMask as it is; this is for flexattn's extras
        (``to_png``, ``adjust`` on any mask, tile states). Example::

            >>> from torch.nn.attention import flex_attention as tf
            >>> tbm = tf.create_block_mask(lambda b, h, q, kv: q >= kv, None, None, 256, 256, device="cpu")
            >>> BlockMask.from_torch(tbm).sparsity() == tbm.sparsity()
            True
        """
        if isinstance(block_mask, cls):
            return block_mask
        if not (hasattr(block_mask, "kv_num_blocks") and hasattr(block_mask, "as_tuple")):
            raise TypeError(f"block_mask must be a torch or flexattn BlockMask, got {type(block_mask).__name__}")
        extra = {name: getattr(block_mask, name, None)
                 for name in ("dq_write_order", "dq_write_order_full", "dq_kv_order", "dq_kv_order_spt")}
        return cls(tuple(block_mask.seq_lengths), block_mask.kv_num_blocks, block_mask.kv_indices,
                   block_mask.full_kv_num_blocks, block_mask.full_kv_indices, block_mask.q_num_blocks,
                   block_mask.q_indices, block_mask.full_q_num_blocks, block_mask.full_q_indices,
                   BLOCK_SIZE=tuple(block_mask.BLOCK_SIZE), mask_mod=block_mask.mask_mod, **extra)

    @property
    def shape(self) -> tuple[int, ...]:
        """(*batch dims, Q_LEN, KV_LEN)."""
        return tuple(self.kv_indices.shape[:-2]) + self.seq_lengths

    @property
    def mask_mod(self) -> Callable:
        return self._mask_mod

    @mask_mod.setter
    def mask_mod(self, mask_mod: Callable) -> None:
        # (a mask_mod assigned later is the one the kernels run, as with torch's BlockMask)
        self._mask_mod = mask_mod
        self._mod: Mod | None = mask_mod if isinstance(mask_mod, Mod) else None

    @property
    def mod(self) -> Mod:
        """``mask_mod`` as a traced `Mod` (what the kernels run), traced once: a tensor it captures is
        read at each call, but a name it captures bound to another object later is not seen (the
        block tables were made from the old one: make the BlockMask again). A mask_mod that reads a
        captured tensor's value in Python (``int(t)``: `Mod.host_values`) is traced again at each
        call, as flex_attention traces such a mod of torch's BlockMask."""
        mod = self._mod
        if mod is None or (mod.host_values and not isinstance(self._mask_mod, Mod)):
            mod = self._mod = as_mod(self.mask_mod)
        return mod

    def numel(self) -> int:
        return math.prod(self.shape)

    def sparsity(self) -> float:
        """Percentage of tiles that are skipped (torch's definition, padding included)."""
        computed = int(self.kv_num_blocks.sum())
        if self.full_kv_num_blocks is not None:
            computed += int(self.full_kv_num_blocks.sum())
        return 100 * (1 - computed * self.BLOCK_SIZE[0] * self.BLOCK_SIZE[1] / self.numel())

    def to_dense(self) -> torch.Tensor:
        """Tile-level dense mask [..., nQ, nKV] (int32 0/1): 1 where a tile is visited."""
        n_cols = self.kv_indices.shape[-1]
        dense = flags(self.kv_num_blocks, self.kv_indices, n_cols)
        if self.full_kv_num_blocks is not None:
            dense = dense | flags(self.full_kv_num_blocks, self.full_kv_indices, self.full_kv_indices.shape[-1])
        return dense.to(torch.int32)

    def tile_states(self) -> torch.Tensor:
        """[..., nQ, nKV] int8: 0 empty, 1 partial, 2 full."""
        return tile_states(self.kv_num_blocks, self.kv_indices, self.full_kv_num_blocks, self.full_kv_indices)

    def to_string(self, grid_size: int | tuple[int, int] = (20, 20), limit: int = 4) -> str:
        """A text picture of the visited tiles, one per (batch, head) (torch's format).

        ``█`` visited, ``░`` partly visited (when several tiles share a character), blank skipped.
        ``grid_size=-1`` draws every tile.
        """
        dense = self.to_dense()
        *batch_dims, n_rows, n_cols = dense.shape
        if isinstance(grid_size, int) and grid_size == -1:
            max_rows, max_cols = n_rows, n_cols
        elif isinstance(grid_size, int):
            max_rows = max_cols = grid_size
        else:
            max_rows, max_cols = grid_size
        row_step = max(1, -(-n_rows // max_rows))
        col_step = max(1, -(-n_cols // max_cols))
        pictures = []
        for i, batch_idx in enumerate(itertools.product(*[range(d) for d in batch_dims])):
            if i == limit:
                pictures += ["...", "To print out more, set BlockMask.to_string(limit=N)",
                             "You can also index (BlockMask[batch, head]) to choose a specific batch or head"]
                break
            m = dense[batch_idx].float()
            lines = [f"{batch_idx}"]
            for r in range(0, n_rows, row_step):
                line = ""
                for c in range(0, n_cols, col_step):
                    frac = m[r:r + row_step, c:c + col_step].mean().item()
                    line += ("█" if frac == 1 else " " if frac == 0 else "░") * 2
                lines.append(line)
            pictures.append("\n".join(lines) + "\n")
        return "\n".join(pictures)

    def __str__(self) -> str:
        return (f"BlockMask(shape={self.shape}, sparsity={self.sparsity():.2f}%, \n"
                f"{self.to_string().strip()}\n)")

    def __repr__(self) -> str:
        def shape(t):
            return None if t is None else t.shape

        name = getattr(self.mask_mod, "__name__", self.mask_mod)
        fields = ["kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                  "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices"]
        body = "".join(f"    {f}={shape(getattr(self, f))},\n" for f in fields)
        return (f"BlockMask(\n{body}    BLOCK_SIZE={self.BLOCK_SIZE},\n    shape={self.shape},\n"
                f"    sparsity={self.sparsity():.2f}%,\n    mask_mod={name}\n)")

    def __getitem__(self, index) -> "BlockMask":
        """Select batches / heads / query tiles (torch semantics: ints keep their dimension).

        Example::

            >>> bm = create_block_mask(lambda b, h, q, kv: q >= kv, 2, 4, 256, 256, "cpu", 64)
            >>> bm[1, 2:4].kv_num_blocks.shape
            torch.Size([1, 2, 4])
        """
        index = index if isinstance(index, tuple) else (index,)
        if len(index) > 3:
            raise IndexError(f"BlockMask indexes at most (batch, head, query tile), got {len(index)} indices")
        padded = (*index, slice(None), slice(None), slice(None))[:3]
        sizes = self.kv_num_blocks.shape[:3]
        index = tuple(
            (slice(i + n, i + n + 1) if -n <= i < 0 else slice(i, i + 1)) if isinstance(i, int) else i
            for i, n in zip(padded, sizes)
        )
        full = (None, None)
        if self.full_kv_num_blocks is not None:
            full = (self.full_kv_num_blocks[index], self.full_kv_indices[index])
        return BlockMask.from_kv_blocks(
            self.kv_num_blocks[index], self.kv_indices[index], *full, BLOCK_SIZE=self.BLOCK_SIZE,
            mask_mod=_sliced_mask_mod_error, seq_lengths=self.seq_lengths,
            compute_q_blocks=self.q_indices is not None,
        )

    def adjust(self, new_q_len: int, new_kv_len: int) -> "BlockMask":
        """Crop to the upper-left ``new_q_len x new_kv_len`` corner (reuse for shorter lengths).

        Keeps, in each remaining query-tile row, the listed tiles whose index is below the new
        KV-tile count; decode steps that attend a prefix of a longer cache use this. Like torch's
        ``_adjust`` (which flex_attention suggests), it re-evaluates nothing; unlike it, the counts
        are right for every mask, not only for masks whose rows start at tile 0.
        """
        _check_positive("new_q_len", new_q_len)
        _check_positive("new_kv_len", new_kv_len)
        if new_q_len > self.seq_lengths[0] or new_kv_len > self.seq_lengths[1]:
            # (the tiles past the old lengths were never classified: they would be skipped silently)
            raise ValueError(f"adjust crops a block mask: ({new_q_len}, {new_kv_len}) is larger than the "
                             f"{self.seq_lengths} it was built for; build the block mask for these lengths")
        rows = -(-new_q_len // self.BLOCK_SIZE[0])
        cols = -(-new_kv_len // self.BLOCK_SIZE[1])

        def crop(num, idx):
            return ordered(flags(num[..., :rows], idx[..., :rows, :], max(idx.shape[-1], cols))[..., :cols])

        kv = crop(self.kv_num_blocks, self.kv_indices)
        full = (None, None)
        if self.full_kv_num_blocks is not None:
            full = crop(self.full_kv_num_blocks, self.full_kv_indices)
        out = BlockMask.from_kv_blocks(*kv, *full, BLOCK_SIZE=self.BLOCK_SIZE, mask_mod=self.mask_mod,
                                       seq_lengths=(new_q_len, new_kv_len),
                                       compute_q_blocks=self.q_indices is not None)
        out._mod = self._mod
        return out

    _adjust = adjust  # torch's name (flex_attention's error message points users to it)

    def to(self, device: torch.device | str) -> "BlockMask":
        """A copy on ``device`` (the traced mod's captured tensors move too)."""
        def move(t):
            return None if t is None else t.to(device)

        out = BlockMask(self.seq_lengths, *(move(t) for t in self.as_tuple()[2:10]),
                        BLOCK_SIZE=self.BLOCK_SIZE, mask_mod=self.mask_mod, validate=False,
                        dq_write_order=move(self.dq_write_order), dq_write_order_full=move(self.dq_write_order_full),
                        dq_kv_order=move(self.dq_kv_order), dq_kv_order_spt=self.dq_kv_order_spt)
        if self._mod is not None:
            m = self._mod
            out._mod = Mod(m.kind, m.ir, [t.to(device) for t in m.buffers], m.name, m.source, m.fn)
        return out

    def check_shape(self, B: int, H: int, Q_LEN: int, KV_LEN: int) -> None:
        """Raise a ValueError unless this mask fits attention over [B, H, Q_LEN] x [.., KV_LEN]
        (the check `flexattn.flex_attention` makes)."""
        check_against(tables_of(self), B, H, Q_LEN, KV_LEN, self.kv_num_blocks.device)

    # -- pictures ---------------------------------------------------------------------------------

    def to_png(self, path: str, batch: int = 0, head: int = 0, level: str = "auto") -> str:
        """Write a picture of (batch, head) to ``path``; see `flexattn.viz.to_png` (needs Pillow)."""
        return viz.to_png(self, path, batch=batch, head=head, level=level)
