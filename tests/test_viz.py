"""flexattn.viz: token- and tile-level pictures, written with Pillow."""

from __future__ import annotations

import pytest
import torch

import flexattn
from flexattn import masks, viz

Image = pytest.importorskip("PIL.Image", reason="Pillow is not installed (pip install 'flexattn[plot]')")


def test_tile_picture(tmp_path):
    bm = flexattn.create_block_mask(masks.prefix_lm(70), 2, 1, 300, 300, device="cpu", BLOCK_SIZE=64)  # 5 x 5 tiles
    path = viz.to_png(bm, tmp_path / "mask.png", batch=1, level="tile")
    img = torch.from_numpy(__import__("numpy").array(Image.open(path)))
    scale = 512 // 5
    assert img.shape == (5 * scale, 5 * scale)
    tiles = img[::scale, ::scale]
    # tile states written out: prefix 70 covers KV tile 0 fully and tile 1 partly, the causal diagonal
    # is partial, and the last query tile (rows 256..319, cut at 300) holds padding: partial at most
    want_states = torch.tensor([[2, 1, 0, 0, 0], [2, 1, 0, 0, 0], [2, 2, 1, 0, 0], [2, 2, 2, 1, 0], [1, 1, 1, 1, 1]])
    assert torch.equal(tiles, torch.tensor([255, 150, 0], dtype=torch.uint8)[want_states])


def test_token_picture_of_flexattn_and_torch_block_masks():
    from torch.nn.attention import flex_attention as torch_flex

    mod = masks.sliding_window(5)
    q, kv = torch.arange(40).view(-1, 1), torch.arange(40).view(1, -1)
    want = torch.where((kv <= q) & (kv > q - 5), 0, 255).to(torch.uint8)
    for bm in (flexattn.create_block_mask(mod, None, None, 40, 40, device="cpu", BLOCK_SIZE=16),
               torch_flex.create_block_mask(mod, None, None, 40, 40, device="cpu", BLOCK_SIZE=16)):
        grey, level = viz.picture(bm)
        assert level == "token" and torch.equal(grey, want)


def test_auto_level_and_errors(tmp_path):
    big = flexattn.create_block_mask(masks.causal, None, None, 2048, 2048, device="cpu")
    assert viz.picture(big)[1] == "tile"
    sliced = big[0, 0]  # slicing drops the mask_mod: only tiles can be drawn
    assert viz.picture(sliced)[1] == "tile"
    with pytest.raises(ValueError, match="level='token' needs the block mask's mask_mod"):
        viz.picture(sliced, level="token")
    from torch.nn.attention import flex_attention as torch_flex

    torch_sliced = torch_flex.create_block_mask(masks.causal, None, None, 64, 64, device="cpu", BLOCK_SIZE=16)[0, 0]
    assert viz.picture(torch_sliced)[1] == "tile"  # torch's sliced masks carry a mask_mod that only raises
    with pytest.raises(ValueError, match="level must be 'auto', 'token' or 'tile', got 'pixels'"):
        viz.picture(big, level="pixels")
    with pytest.raises(IndexError, match=r"batch must be in \[0, 2\), got 5"):
        viz.tile_grid(flexattn.create_block_mask(masks.prefix_lm(torch.tensor([1, 2])), 2, 1, 64, 64, "cpu"), batch=5)
    with pytest.raises(FileNotFoundError, match="the directory .* does not exist"):
        viz.to_png(big, tmp_path / "missing" / "x.png")


def test_drawing_leaves_matplotlibs_backend_alone(tmp_path):
    import sys

    had = "matplotlib" in sys.modules
    bm = flexattn.create_block_mask(masks.causal, None, None, 64, 64, device="cpu", BLOCK_SIZE=16)
    bm.to_png(str(tmp_path / "m.png"))
    assert ("matplotlib" in sys.modules) == had


def test_token_picture_evaluates_only_the_head_drawn(monkeypatch):
    from flexattn import reference

    shapes = []
    evaluate = reference.evaluate_mask

    def spy(mask_mod, B, H, Q_LEN, KV_LEN, device):
        shapes.append((B, H, Q_LEN, KV_LEN))
        return evaluate(mask_mod, B, H, Q_LEN, KV_LEN, device)

    def mod(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (kv_idx >= 2 * b + h)

    bm = flexattn.create_block_mask(mod, 3, 4, 37, 45, device="cpu", BLOCK_SIZE=16)
    monkeypatch.setattr(reference, "evaluate_mask", spy)
    grey, level = viz.picture(bm, batch=2, head=3)
    q, kv = torch.arange(37).view(-1, 1), torch.arange(45).view(1, -1)
    assert level == "token" and torch.equal(grey, torch.where((q >= kv) & (kv >= 7), 0, 255).to(torch.uint8))
    assert shapes == [(1, 1, 37, 45)]  # one head, not a dense [B, H, Q_LEN, KV_LEN] mask


def test_tile_picture_has_the_tiles_of_the_lengths():
    from flexattn.block_mask import BlockMask

    nb = torch.tensor([[[3]]], dtype=torch.int32)
    idx = torch.tensor([[[[0, 1, 2, 0]]]], dtype=torch.int32)  # one column more than KV_LEN 40 has tiles
    bm = BlockMask.from_kv_blocks(nb, idx, BLOCK_SIZE=16, seq_lengths=(16, 40))
    assert torch.equal(viz.picture(bm, level="tile")[0], torch.tensor([[150, 150, 150]], dtype=torch.uint8))


def test_tile_picture_of_each_batch_and_head():
    """The tile picture of (batch, head) is that of a mask built for that batch row and head alone."""
    prefix = torch.tensor([70, 200])

    def mod(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) | (kv_idx < prefix[b] - 60 * h)

    bm = flexattn.create_block_mask(mod, 2, 2, 300, 300, device="cpu", BLOCK_SIZE=64)
    grids = set()
    for b in range(2):
        for h in range(2):
            def alone(b_, h_, q_idx, kv_idx, p=int(prefix[b]) - 60 * h):
                return (q_idx >= kv_idx) | (kv_idx < p)

            one = flexattn.create_block_mask(alone, 1, 1, 300, 300, device="cpu", BLOCK_SIZE=64)
            grid = viz.tile_grid(bm, batch=b, head=h)
            assert torch.equal(grid, viz.tile_grid(one)), (b, h)
            grids.add(tuple(grid.flatten().tolist()))
    assert len(grids) == 4  # (each batch row and head draws a picture of its own)
