"""The dtype an engine computes in (docs/engines.md, "Mixed precision").

On CPU, bfloat16 and float16 inputs are computed in float32 inside the engines — scores,
log-sum-exps, softmax denominators, sparse-map thresholds and the weighted sums — and the
output (and the gradients) come back in the inputs' dtype, as torch's own math attention does
for half inputs. Rounding the *scores* to 8 bits of mantissa alone moves the support of a
sparse map: ∂q of sparsemax on bf16 scores was 10% off a float64 reference, 0.24% with
float32 scores (n = 256, 4 heads; docs/engines.md, "Mixed precision"; ``tests/test_dtypes.py``
holds every engine to 1% in bf16). float16 matrix products are also several times slower than
float32 ones on CPU. On a GPU the engines keep the inputs' dtype (tensor cores);
the maps threshold half-precision rows in float32 there (:mod:`sparseattn.maps`).
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
