"""The dtype an engine computes in (docs/engines.md, "Mixed precision").

On CPU, bfloat16 and float16 inputs are computed in float32 inside the engines, and the output
(and the gradients) come back in the inputs' dtype, as torch's own math attention does: scores
rounded to 8 bits of mantissa move the support of a sparse map. On a GPU the engines keep the
inputs' dtype (tensor cores); the maps threshold half-precision rows in float32 there.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["HALF", "compute_dtype"]

#: The half-precision dtypes that are widened to float32 on CPU.
HALF = (torch.bfloat16, torch.float16)


def compute_dtype(x: Tensor) -> torch.dtype:
    """float32 for a bfloat16/float16 tensor on CPU, else ``x.dtype``."""
    if x.dtype in HALF and x.device.type == "cpu":
        return torch.float32
    return x.dtype
