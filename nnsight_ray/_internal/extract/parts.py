"""A layer output's residual stream, read the same way by every reader of it.

vLLM's decoder layers return ``(hidden, residual)``, two same-shape tensors whose
sum is the residual stream; other modules return one tensor or a tuple led by
it. The batch pipeline's Parquet saves and the ranks' activation files both read
a location through this one function, so both formats hold the same values.
"""

from __future__ import annotations

from typing import Any


def residual_parts(value: Any) -> tuple:
    """The tensors whose sum is a layer output's residual stream: a same-shape pair, else the first item."""
    import torch

    if isinstance(value, (tuple, list)):
        if (
            len(value) == 2
            and all(isinstance(v, torch.Tensor) for v in value)
            and value[0].shape == value[1].shape
        ):
            return (value[0], value[1])
        return (value[0],)
    return (value,)
