"""Test helpers, not shipped with flexattn.

`helpers.testing`: random IR strategies, index grids, float64 references, IR -> Python source.
`helpers.grid_kernel`: evaluate a mod over a full index grid with a generated Triton kernel.
"""
