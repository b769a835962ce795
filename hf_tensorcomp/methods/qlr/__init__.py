"""``qlr``: a quantized weight plus a calibrated low-rank correction (`method`), stored as a
`QuantizedLowRankLinear` (`layer`). The quantizers themselves (`decompositions.quantize`), the input
rotation (`decompositions.hadamard`) and the budget's greedy rule (`decompositions.allocation`) are
shared with other methods and stay there.
"""

from .layer import QuantizedLowRankLinear, share_input_rotations
from .method import QuantizedLowRank

__all__ = ["QuantizedLowRank", "QuantizedLowRankLinear", "share_input_rotations"]
