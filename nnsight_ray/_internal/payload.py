"""Saved values on the wire: nnsight's compact pickle with a fast path for tensors.

Problem. nnsight ships a rank's saves with ``dumps_compact``, plain pickle
where a tensor viewing a larger buffer is written as a copy of itself. Plain
pickle writes every tensor through ``torch.save`` of its storage and reads it
back through ``torch.load``: ~100 us to write and ~250 us to read one small
tensor, whatever its size. A trace saving every layer at every token carries
thousands of small tensors, and each crosses three pickles on its way home
(rank, merge actor, caller), so serialization, not the forward, bounded how
fast saved values came back (measured in docs/performance.md).

Design. ``dumps`` is nnsight's compact pickler with one more rule: a plain
dense tensor (exactly ``torch.Tensor``, no grad, not quantized or sparse) is
written as a numpy array, one protocol-5 buffer holding only its own elements,
and read back with ``torch.from_numpy`` over a writable ``bytearray``. dtypes
numpy lacks (bfloat16, float8, complex32) travel as the same-size integer
dtype and are viewed back. The result
is still plain pickle (``pickle.loads`` reads it anywhere ``nnsight_ray``
imports), still compact, and equal in value, dtype and shape. A tensor on a GPU
arrives on the CPU: the merge actor and the caller need no GPU to read it
(nnsight's in-process engine hands back device tensors; here the values have
left the device's process anyway). Everything else (tensor subclasses, tensors
needing grad) goes the way nnsight sends it.

- Ranks: ``nnsight_ray_stash`` collects with nnsight's own ``collect_nnsight``
  inside ``unserialized()`` and pickles the dict with ``dumps``.
- The merge actor: nnsight's ``merge_collected`` reads these bytes with plain
  ``pickle.loads``; what it returns to callers is wrapped in ``Packed``, so Ray
  writes it with ``dumps`` too and the caller's ``ray.get`` gets the value
  itself, never a wrapper.
"""

from __future__ import annotations

import io
import pickle
from contextlib import contextmanager
from typing import Any, Iterator

import torch
from nnsight.modeling.vllm.collect import _CompactPickler


def _from_numpy(array: Any) -> torch.Tensor:
    return torch.from_numpy(array)


def _from_numpy_as(array: Any, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(array).view(dtype)


# dtypes numpy lacks travel as the same-size integer and are viewed back
_CARRIER = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NUMPY_LACKS = {torch.bfloat16, torch.complex32, *(v for k, v in vars(torch).items() if k.startswith("float8_"))}


def _reduce_tensor(obj: torch.Tensor) -> Any:
    tensor = obj if obj.device.type == "cpu" else obj.cpu()
    if tensor.is_conj() or tensor.is_neg():
        tensor = tensor.resolve_conj().resolve_neg()
    # numpy writes only this tensor's elements (compact), as one buffer
    if tensor.dtype in _NUMPY_LACKS:
        return _from_numpy_as, (tensor.view(_CARRIER[tensor.element_size()]).numpy(), tensor.dtype)
    return _from_numpy, (tensor.numpy(),)


class _Pickler(_CompactPickler):
    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is torch.Tensor and not obj.requires_grad and obj.layout == torch.strided and not obj.is_quantized:
            try:
                return _reduce_tensor(obj)
            except (RuntimeError, TypeError, NotImplementedError):  # a meta tensor, ...: nnsight's way
                pass
        return super().reducer_override(obj)


def dumps(value: Any) -> bytes:
    """Pickle ``value`` like nnsight's ``dumps_compact``, plain tensors as numpy buffers (on the CPU)."""
    buffer = io.BytesIO()
    _Pickler(buffer, pickle.HIGHEST_PROTOCOL).dump(value)
    return buffer.getvalue()


class Packed:
    """A return value Ray serializes with ``dumps``; unpickles as the value itself.

    Falls back to Ray's own serializer (cloudpickle) for what plain pickle
    cannot write, such as a class defined in a caller's ``__main__``.
    """

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __reduce__(self) -> Any:
        try:
            return pickle.loads, (dumps(self.value),)
        except Exception:
            return _identity, (self.value,)


def _identity(value: Any) -> Any:
    return value


@contextmanager
def unserialized() -> Iterator[None]:
    """Within: nnsight's ``collect_nnsight`` returns its dict instead of pickling it.

    nnsight 0.8.1 pickles at the end of ``collect_nnsight`` with
    ``dumps_compact``, a global of its runner module; the one seam is to bind
    that name to the identity for the call. Only a rank's worker thread runs
    ``collect_nnsight``, one call at a time, so no other caller sees the swap.
    Can go when nnsight separates collecting from serializing.
    """
    from nnsight.modeling.vllm.model_runners import GPUModelRunner as runner_module

    original = runner_module.dumps_compact
    runner_module.dumps_compact = _identity
    try:
        yield
    finally:
        runner_module.dumps_compact = original
