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


# Device tensors up to this size are copied to the host together (one synchronization for all of
# them); larger ones, whose copy outweighs a synchronization, go one by one as before.
BATCH_BYTES = 1 << 20
# The most device memory one batched copy stages at once.
BATCH_LIMIT = 256 << 20


def _batchable(tensor: torch.Tensor) -> bool:
    return (type(tensor) is torch.Tensor and tensor.device.type != "cpu" and not tensor.requires_grad
            and tensor.layout == torch.strided and not tensor.is_quantized
            and tensor.numel() * tensor.element_size() <= BATCH_BYTES)


def to_host(values: list[Any]) -> list[Any]:
    """``values`` with every small device tensor reachable through containers on the host, copied in batches.

    A trace saving a value at every step of hundreds of requests leaves
    thousands of small tensors on the device; ``.cpu()`` on each is one
    device synchronization each (and, on a rank's second thread, each waits for
    whatever step the engine queued meanwhile). Here tensors of one device
    and dtype are concatenated on the device (one kernel), copied once, and
    split back on the host: one synchronization per group. Containers (dict,
    list, tuple, set) are rebuilt as nnsight's ``apply`` rebuilds them; other
    objects and large tensors are left for the pickler, which copies them itself.
    """
    from nnsight.util import apply

    groups: dict[tuple[Any, torch.dtype], list[torch.Tensor]] = {}

    def note(tensor: torch.Tensor) -> torch.Tensor:
        if _batchable(tensor):
            groups.setdefault((tensor.device, tensor.dtype), []).append(tensor)
        return tensor

    apply(values, note, torch.Tensor)
    if not groups:
        return values
    host: dict[int, torch.Tensor] = {}
    for tensors in groups.values():
        unique = list({id(t): t for t in tensors}.values())
        start = 0
        while start < len(unique):  # chunks of at most BATCH_LIMIT bytes
            chunk, size = [], 0
            while start < len(unique) and (not chunk or size + unique[start].nbytes <= BATCH_LIMIT):
                size += unique[start].nbytes
                chunk.append(unique[start])
                start += 1
            flat = torch.cat([t.reshape(-1) for t in chunk]).cpu()
            for tensor, part in zip(chunk, torch.split(flat, [t.numel() for t in chunk])):
                host[id(tensor)] = part.view(tensor.shape)
    return apply(values, lambda t: host.get(id(t), t), torch.Tensor)


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
