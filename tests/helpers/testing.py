"""All test helpers under one name (``from helpers import testing``); each lives in its own module:

`helpers.grids` index grids and scores, `helpers.references` float64 references and tolerances,
`helpers.strategies` random IR for hypothesis, `helpers.to_python` IR -> Python source,
`helpers.calls` call recording and CUDA-graph capture.
"""

from helpers.calls import capture_after_warmup, record_calls
from helpers.grids import MAX_BH, MAX_LEN, SCORE_BOUND, eval_grid, grid_inputs, index_grid, random_score
from helpers.references import (assert_close_to_reference, backward_atol, buffers_float64, dequantised,
                                eager_reference, quantise_fp8, reference_fp64, tile_states_of_dense,
                                to_float64, weighted_grads)
from helpers.strategies import int_irs, mask_irs, score_irs
from helpers.to_python import python_mod, to_python

__all__ = ["MAX_BH", "MAX_LEN", "SCORE_BOUND", "assert_close_to_reference", "backward_atol", "buffers_float64",
           "capture_after_warmup", "dequantised", "eager_reference", "eval_grid", "grid_inputs", "index_grid",
           "int_irs", "mask_irs", "python_mod", "quantise_fp8", "random_score", "record_calls", "reference_fp64",
           "score_irs", "tile_states_of_dense", "to_float64", "to_python", "weighted_grads"]
