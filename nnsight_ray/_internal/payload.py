"""Saved values on the wire: nnsight's compact pickle, every plain tensor packed into one buffer per dtype.

Problem. nnsight ships a rank's saves with ``dumps_compact``, plain pickle
where a tensor viewing a larger buffer is written as a copy of itself. Plain
pickle writes every tensor through ``torch.save`` of its storage and reads it
back through ``torch.load``: ~100 us to write and ~250 us to read one small
tensor, whatever its size. Writing each tensor as a numpy buffer (this module's
first form) cut that to ~25 us a tensor a hop, still per tensor and, on a GPU,
one device synchronization per tensor: a trace saving one value at every step
of 256 requests carries 8,192 small tensors, and on the H200 moving them
rank -> merge actor -> caller took 1.4 s of a 2 s run (py-spy,
docs/performance.md, "Where the time goes").

Design. ``dumps`` is nnsight's compact pickler in which a plain dense tensor
(exactly ``torch.Tensor``, no grad, strided, not quantized, not on the meta
device) is written as a persistent id, an index into the payload's tensors.
After the structure is pickled, the tensors of one device and dtype are
concatenated (one kernel on a GPU), copied off the device once, and written as
one protocol-5 buffer per dtype beside the structure; each tensor is an offset
and a shape. The result is plain pickle (``pickle.loads`` reads it anywhere
``nnsight_ray`` imports: a reduce to ``_unpack``), compact (a tensor carries
only its own elements), and equal in value, dtype and shape; each loaded tensor
is a view of its dtype's buffer, which is writable (a ``bytearray``). A tensor
on a GPU arrives on the CPU: the merge actor and the caller need no GPU to read
it. One object saved twice is one tensor when it arrives. Everything else
(tensor subclasses, tensors needing grad) goes the way nnsight sends it.

- Ranks: ``nnsight_ray_stash`` collects with nnsight's own ``collect_nnsight``
  inside ``unserialized()``; the merge actor's call pickles each request's
  entry with ``dumps`` (one device copy per dtype per request).
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


def _packable(obj: Any) -> bool:
    return (type(obj) is torch.Tensor and not obj.requires_grad and obj.layout == torch.strided
            and not obj.is_quantized and obj.device.type != "meta")


class _Pickler(_CompactPickler):
    """nnsight's compact pickler; plain tensors become indices into ``self.tensors``."""

    def __init__(self, file: Any, protocol: int) -> None:
        super().__init__(file, protocol)
        self.tensors: list[torch.Tensor] = []
        self._index: dict[int, int] = {}

    def persistent_id(self, obj: Any) -> Any:
        if not _packable(obj):
            return None
        index = self._index.get(id(obj))
        if index is None:
            index = self._index[id(obj)] = len(self.tensors)
            self.tensors.append(obj)
        return index


def _pack(tensors: list[torch.Tensor]) -> tuple[list[Any], list[tuple[int, int, int, tuple[int, ...]]]]:
    """One host buffer per dtype (a uint8 array, for protocol 5) and, per tensor, (buffer, offset, numel, shape)."""
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for index, tensor in enumerate(tensors):
        groups.setdefault((tensor.device, tensor.dtype), []).append(index)
    buffers: list[tuple[Any, torch.dtype]] = []
    specs: list[Any] = [None] * len(tensors)
    for (_, dtype), members in groups.items():
        parts = [_flat(tensors[i]) for i in members]
        flat = (torch.cat(parts) if len(parts) > 1 else parts[0]).cpu()  # one kernel, one copy off the device
        offset = 0
        for i, part in zip(members, parts):
            specs[i] = (len(buffers), offset, part.numel(), tuple(tensors[i].shape))
            offset += part.numel()
        buffers.append((pickle.PickleBuffer(flat.view(torch.uint8).numpy()) if flat.numel() else b"", dtype))
    return buffers, specs


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.is_complex():
        tensor = tensor.resolve_conj().resolve_neg()
    return tensor if tensor.dim() == 1 and tensor.is_contiguous() else tensor.reshape(-1).contiguous()


def _unpack(structure: bytes, buffers: list[tuple[Any, torch.dtype]], specs: list[Any]) -> Any:
    """``dumps``'s payload back: each dtype's buffer viewed once, each tensor a view of it, then the structure."""
    tensors: list[Any] = [None] * len(specs)
    members: list[list[int]] = [[] for _ in buffers]
    for i, spec in enumerate(specs):
        members[spec[0]].append(i)  # in buffer order
    for (buffer, dtype), indices in zip(buffers, members):
        base = torch.frombuffer(buffer, dtype=torch.uint8).view(dtype) if len(buffer) else torch.empty(0, dtype=dtype)
        for i, piece in zip(indices, torch.split(base, [specs[i][2] for i in indices])):
            shape = specs[i][3]
            tensors[i] = piece if len(shape) == 1 else piece.view(shape)
    unpickler = pickle.Unpickler(io.BytesIO(structure))
    unpickler.persistent_load = tensors.__getitem__
    return unpickler.load()


class _Payload:
    __slots__ = ("structure", "buffers", "specs")

    def __init__(self, structure: bytes, buffers: list, specs: list) -> None:
        self.structure, self.buffers, self.specs = structure, buffers, specs

    def __reduce__(self) -> Any:
        return _unpack, (self.structure, self.buffers, self.specs)


def dumps(value: Any) -> bytes:
    """Pickle ``value`` like nnsight's ``dumps_compact``, plain tensors packed per dtype (on the CPU)."""
    buffer = io.BytesIO()
    pickler = _Pickler(buffer, pickle.HIGHEST_PROTOCOL)
    pickler.dump(value)
    if not pickler.tensors:
        return buffer.getvalue()
    buffers, specs = _pack(pickler.tensors)
    return pickle.dumps(_Payload(buffer.getvalue(), buffers, specs), protocol=pickle.HIGHEST_PROTOCOL)


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
