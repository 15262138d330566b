"""Test helpers, not shipped with flexattn.

`helpers.grids` index grids and scores, `helpers.references` float64 references and tolerances,
`helpers.strategies` random IR for hypothesis, `helpers.to_python` IR -> Python source,
`helpers.calls` call recording and CUDA-graph capture; `helpers.testing` re-exports them all.
`helpers.grid_kernel`: evaluate a mod over a full index grid with a generated Triton kernel.
"""
