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
device) is written as an index into the payload's tensors (``_tensor_at``).
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
  inside ``unserialized()``; the merge actor's call (``take_payloads``) packs
  every request's entry at once (``ship_each``: one device copy per dtype for
  all of them) into ``Shipped`` payloads, whose buffers Ray writes out of band,
  straight into its object store (no copy into a pickle stream, none out of it).
- The merge actor: each arrives as an ``Arrived`` (the structure's bytes, its
  tensors beside them); nnsight's ``merge_collected`` reads it with plain
  ``pickle.loads`` inside ``arrived(...)``, which lets each payload's
  ``_tensor_of(token, i)`` find its own tensors (several ranks' payloads of one
  request load together). What it returns to callers is wrapped in ``Packed``,
  so Ray writes it with ``dumps`` too and the caller's ``ray.get`` gets the
  value itself, never a wrapper.
"""

from __future__ import annotations

import io
import pickle
import threading
import uuid
from contextlib import contextmanager
from typing import Any, Iterator

import torch
from nnsight.modeling.vllm.collect import _CompactPickler
from torch._utils import _flatten_dense_tensors


def _packable(obj: Any) -> bool:
    # Attribute reads only (``is_meta``, not ``device.type``: a ``torch.device`` is built per read), as this
    # runs for every saved tensor, twice on its way home.
    return (type(obj) is torch.Tensor and not obj.requires_grad and obj.layout == torch.strided
            and not obj.is_quantized and not obj.is_meta)


class _Pickler(_CompactPickler):
    """nnsight's compact pickler; plain tensors become indices into ``self.tensors``.

    A tensor is caught in ``reducer_override``, which pickle consults only for
    objects that are not ints, floats, strings, bytes, lists, tuples, dicts or
    sets: a ``persistent_id`` would be a Python call for every object, every
    token id of every output included (6.5x plain pickle's time for 2,048
    prefill outputs; benchmarks/results/HISTORY.md).
    """

    def __init__(self, file: Any, protocol: int, token: str | None = None) -> None:
        super().__init__(file, protocol)
        self.tensors: list[torch.Tensor] = []
        self._index: dict[int, int] = {}
        self.token = token  # set: the tensors are ``_tensor_of(token, index)`` (a ``Shipped`` payload)

    def reducer_override(self, obj: Any) -> Any:
        if not _packable(obj):
            return super().reducer_override(obj)
        index = self._index.get(id(obj))
        if index is None:
            index = self._index[id(obj)] = len(self.tensors)
            self.tensors.append(obj)
        return (_tensor_at, (index,)) if self.token is None else (_tensor_of, (self.token, index))


# The tensors of the payloads being loaded on this thread, innermost last (``_unpack``, ``_tensor_at``).
_loading = threading.local()


def _tensor_at(index: int) -> torch.Tensor:
    """The ``index``-th tensor of the payload being loaded (what a packed tensor unpickles to)."""
    return _loading.stack[-1][index]


def _tensor_of(token: str, index: int) -> torch.Tensor:
    """The ``index``-th tensor of the arrived payload ``token`` (what a shipped tensor unpickles to)."""
    for frame in reversed(_loading.__dict__.get("frames", ())):
        if token in frame:
            return frame[token][index]
    raise pickle.UnpicklingError(f"payload {token}'s tensors are not here: load it with payload.loads")


# A CPU storage is sent whole, its tensors as offsets into it, when they cover at least this share of it.
FORWARD_COVERAGE = 0.5


def _pack(tensors: list[torch.Tensor]) -> tuple[list[Any], list[tuple[int, int, int, tuple[int, ...]]]]:
    """Host buffers (uint8 arrays, for protocol 5) with their dtype and, per tensor, (buffer, offset, numel, shape).

    Contiguous CPU tensors of one dtype that share a storage and cover most of
    it (what ``_unpack`` made on the merge actor: views of a rank's buffer) go
    as that storage itself, each an offset into it: nothing is concatenated.
    Every other tensor is packed with the others of its device and dtype: one
    concatenation (one kernel) and one copy off the device.
    """
    return _pack_many([tensors])[0]


# One concatenation on a device holds at most this many bytes (a copy of the saves it packs).
PACK_CHUNK_BYTES = 256 << 20


def _pack_many(lists: list[list[torch.Tensor]]) -> list[tuple[list[Any], list[Any]]]:
    """``_pack`` of several payloads' tensors, the device copies shared: per device and dtype, one
    concatenation and one copy off the device for all of them (in chunks of ``PACK_CHUNK_BYTES``), not
    one per payload. Each payload's buffers are its own slices of the shared host copy."""
    results: list[tuple[list[Any], list[Any]]] = []
    # (device, dtype) -> [(payload, tensor index, flat part)], in payload order
    groups: dict[tuple[torch.device, torch.dtype], list[tuple[int, int, torch.Tensor]]] = {}
    for which, tensors in enumerate(lists):
        buffers: list[tuple[Any, torch.dtype]] = []
        specs: list[Any] = [None] * len(tensors)
        for index in _forward_storages(tensors, buffers, specs):
            tensor = tensors[index]
            part = _flat(tensor) if tensor.is_complex() else tensor  # a conjugate's bits resolved first
            groups.setdefault((tensor.device, tensor.dtype), []).append((which, index, part))
        results.append((buffers, specs))
    for (_, dtype), members in groups.items():
        for chunk in _chunks(members):
            parts = [part for _, _, part in chunk]
            # One kernel and one copy off the device. ``_flatten_dense_tensors`` (PyTorch's own, as DDP's
            # buckets use it) flattens and concatenates in C++: no Python call per tensor.
            flat = (_flatten_dense_tensors(parts) if len(parts) > 1 else _flat(parts[0])).cpu()
            host = flat.view(torch.uint8).numpy() if flat.numel() else None
            size = flat.element_size()
            runs: dict[int, list[tuple[int, torch.Tensor]]] = {}  # one buffer per payload: its members here
            for which, index, part in chunk:
                runs.setdefault(which, []).append((index, part))
            first = 0
            for which, run in runs.items():
                buffers, specs = results[which]
                offset = 0
                for index, part in run:
                    specs[index] = (len(buffers), offset, part.numel(), tuple(lists[which][index].shape))
                    offset += part.numel()
                buffers.append((pickle.PickleBuffer(host[first * size:(first + offset) * size]) if offset else b"",
                                dtype))
                first += offset
    return results


def _chunks(members: list[tuple[int, int, torch.Tensor]]) -> Iterator[list[tuple[int, int, torch.Tensor]]]:
    """``members`` in consecutive runs of at most ``PACK_CHUNK_BYTES`` (a larger tensor alone)."""
    chunk: list[tuple[int, int, torch.Tensor]] = []
    size = 0
    for member in members:
        nbytes = member[2].numel() * member[2].element_size()
        if chunk and size + nbytes > PACK_CHUNK_BYTES:
            yield chunk
            chunk, size = [], 0
        chunk.append(member)
        size += nbytes
    if chunk:
        yield chunk


def _forward_storages(tensors: list[torch.Tensor], buffers: list[Any], specs: list[Any]) -> list[int]:
    """Give tensors that can travel as offsets into their whole CPU storage a spec; return the others' indices."""
    by_storage: dict[int, list[int]] = {}
    rest: list[int] = []
    for index, tensor in enumerate(tensors):  # cheap reads first: most tensors are not views of a CPU buffer
        if tensor.is_cpu and tensor._base is not None:
            by_storage.setdefault(tensor.untyped_storage().data_ptr(), []).append(index)
        else:
            rest.append(index)
    for members in by_storage.values():
        first = tensors[members[0]]
        if len(members) < 2:
            rest.extend(members)
            continue
        storage = first.untyped_storage()
        size, dtype = storage.nbytes(), first.dtype
        covered = sum(tensors[i].numel() for i in members) * first.element_size()
        if size % first.element_size() or covered < FORWARD_COVERAGE * size or dtype.is_complex \
                or any(tensors[i].dtype != dtype or not tensors[i].is_contiguous()
                       or tensors[i].is_neg() for i in members):  # a lazy negation is not in the bytes
            rest.extend(members)
            continue
        whole = torch.empty(0, dtype=torch.uint8).set_(storage)
        for i in members:
            specs[i] = (len(buffers), tensors[i].storage_offset(), tensors[i].numel(), tuple(tensors[i].shape))
        buffers.append((pickle.PickleBuffer(whole.numpy()), dtype))
    # In the payload's order: packed so, tensors of one shape saved one after another (a value at every
    # step) lie back to back, and arrive as one view (``_runs``), here and wherever the buffer is forwarded.
    return sorted(rest)


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.is_complex() or tensor.is_neg():  # lazy conjugation and negation are not in the bytes
        tensor = tensor.resolve_conj().resolve_neg()
    return tensor if tensor.dim() == 1 and tensor.is_contiguous() else tensor.reshape(-1).contiguous()


def _unpack(structure: bytes, buffers: list[tuple[Any, torch.dtype]], specs: list[Any]) -> Any:
    """``dumps``'s payload back: each dtype's buffer viewed once, each tensor a view of it, then the structure.

    A buffer that arrives read-only (out of band from Ray's object store) is
    copied once, so every loaded tensor is writable and owns its memory.
    """
    tensors = _views(buffers, specs)
    stack = _loading.__dict__.setdefault("stack", [])
    stack.append(tensors)
    try:
        return pickle.loads(structure)
    finally:
        stack.pop()


def _views(buffers: list[tuple[Any, torch.dtype]], specs: list[Any]) -> list[torch.Tensor]:
    """The payload's tensors: each dtype's buffer viewed once (copied once if read-only), each tensor a view."""
    tensors: list[Any] = [None] * len(specs)
    members: list[list[int]] = [[] for _ in buffers]
    for i, spec in enumerate(specs):
        members[spec[0]].append(i)
    for (buffer, dtype), indices in zip(buffers, members):
        if not len(buffer):
            base = torch.empty(0, dtype=dtype)
        else:
            if memoryview(buffer).readonly:
                buffer = bytearray(buffer)
            base = torch.frombuffer(buffer, dtype=torch.uint8).view(dtype)
        for run in _runs(indices, specs):
            first = specs[run[0]]
            offset, size, shape = first[1], first[2], first[3]
            if len(run) == 1:
                tensors[run[0]] = base.narrow(0, offset, size).view(shape)
            else:  # consecutive tensors of one shape: one view, unbound (no Python call per tensor)
                pieces = base.narrow(0, offset, size * len(run)).view(len(run), *shape).unbind(0)
                for i, piece in zip(run, pieces):
                    tensors[i] = piece
    return tensors


def _runs(indices: list[int], specs: list[Any]) -> Iterator[list[int]]:
    """``indices`` (one buffer's tensors) in runs of equal shape that lie back to back in the buffer."""
    run: list[int] = []
    end = None
    for i in indices:
        _, offset, size, shape = specs[i]
        if run and (offset != end or shape != specs[run[0]][3]):
            yield run
            run = []
        run.append(i)
        end = offset + size
    if run:
        yield run


class _Payload:
    __slots__ = ("structure", "buffers", "specs")

    def __init__(self, structure: bytes, buffers: list, specs: list) -> None:
        self.structure, self.buffers, self.specs = structure, buffers, specs

    def __reduce__(self) -> Any:
        return _unpack, (self.structure, self.buffers, self.specs)


def _structure(value: Any, token: str | None = None) -> tuple[bytes, list[torch.Tensor]]:
    """``value`` pickled with its plain tensors left out (indices, ``_tensor_at``; ``_tensor_of`` with a
    ``token``), and those tensors."""
    buffer = io.BytesIO()
    pickler = _Pickler(buffer, pickle.HIGHEST_PROTOCOL, token)
    pickler.dump(value)
    return buffer.getvalue(), pickler.tensors


def _payload(value: Any) -> Any:
    """``value`` as one structure plus its tensors' buffers (a ``_Payload``), or plain pickle bytes if it has none."""
    structure, tensors = _structure(value)
    if not tensors:
        return structure
    buffers, specs = _pack(tensors)
    return _Payload(structure, buffers, specs)


def dumps_each(values: list[Any]) -> list[bytes | Exception]:
    """``dumps`` of each value, their copies off the device shared (``_pack_many``): for many small
    payloads (a batch of finished requests), one concatenation and one device copy per dtype instead of
    one per payload. A value that cannot be pickled is its exception here; the others are unaffected."""
    results = _packed_each(values, tokens=False)
    for i, packed in enumerate(results):
        if isinstance(packed, tuple):
            try:
                results[i] = _bytes(_Payload(*packed))
            except Exception as exception:
                results[i] = exception
    return results


def ship_each(values: list[Any]) -> list[Any]:
    """Each value as a ``Shipped`` payload (bytes if it holds no tensor, its exception if it cannot be
    pickled), packed as ``dumps_each`` packs them: for a rank to hand to a merge actor through Ray."""
    return [Shipped(*packed) if isinstance(packed, tuple) else packed for packed in _packed_each(values, tokens=True)]


def _packed_each(values: list[Any], tokens: bool) -> list[Any]:
    """Per value: ``(structure, buffers, specs[, token])`` (its tensors packed with the others',
    ``_pack_many``; with ``tokens``, a ``Shipped``'s token), plain pickle bytes (no tensor, or the shared
    copy failed), or its exception."""
    results: list[Any] = [None] * len(values)
    pending: list[tuple[int, bytes, list[torch.Tensor], str | None]] = []
    for i, value in enumerate(values):
        token = uuid.uuid4().hex if tokens else None
        try:
            structure, tensors = _structure(value, token)
        except Exception as exception:
            results[i] = exception
            continue
        if tensors:
            pending.append((i, structure, tensors, token))
        else:
            results[i] = structure
    try:
        packs = _pack_many([tensors for _, _, tensors, _ in pending])
    except Exception:  # one payload's tensor the shared copy cannot take: each on its own, as dumps does
        packs = None
    for k, (i, structure, _, token) in enumerate(pending):
        if packs is None:
            try:
                results[i] = dumps(values[i])
            except Exception as exception:
                results[i] = exception
        else:
            results[i] = (structure, *packs[k]) + ((token,) if tokens else ())
    return results


class Shipped:
    """A rank's payload on its way to a merge actor: the structure (tensors as ``_tensor_of(token, i)``)
    and one buffer per dtype, which Ray (pickle protocol 5) writes out of band, straight into its object
    store. It arrives as an ``Arrived``: no in-band copy of the tensors' bytes on either side, where
    ``dumps_each``'s bytes were copied into the pickle stream, into the object store and out again."""

    __slots__ = ("structure", "buffers", "specs", "token")

    def __init__(self, structure: bytes, buffers: list, specs: list, token: str) -> None:
        self.structure, self.buffers, self.specs, self.token = structure, buffers, specs, token

    def __reduce_ex__(self, protocol: int) -> Any:
        buffers = self.buffers
        if protocol < 5:  # no PickleBuffer before protocol 5: the bytes go in the stream
            buffers = [(b.raw().tobytes() if isinstance(b, pickle.PickleBuffer) else b, dtype) for b, dtype in buffers]
        return _arrive, (self.structure, buffers, self.specs, self.token)


class Arrived(bytes):
    """A ``Shipped`` payload where it arrived: the structure's bytes, its tensors beside them
    (``tensors``, views of one writable copy of each buffer). ``loads`` reads it (with the tensors);
    ``nbytes`` is what it carried."""

    token: str
    tensors: list[torch.Tensor]
    nbytes: int


def _arrive(structure: bytes, buffers: list[tuple[Any, torch.dtype]], specs: list[Any], token: str) -> Arrived:
    arrived = Arrived(structure)
    arrived.token, arrived.tensors = token, _views(buffers, specs)
    arrived.nbytes = len(structure) + sum(memoryview(b).nbytes for b, _ in buffers)
    return arrived


@contextmanager
def arrived(payloads: list[Any]) -> Iterator[None]:
    """Within: ``pickle.loads`` of any ``Arrived`` in ``payloads`` finds its tensors (nnsight's
    ``merge_collected`` takes bytes and loads them itself)."""
    frame = {p.token: p.tensors for p in payloads if isinstance(p, Arrived)}
    if not frame:
        yield
        return
    frames = _loading.__dict__.setdefault("frames", [])
    frames.append(frame)
    try:
        yield
    finally:
        frames.pop()


def loads(payload: bytes) -> Any:
    """A rank's payload (``Arrived`` or bytes) as its value."""
    with arrived([payload]):
        return pickle.loads(payload)


def _bytes(packed: Any) -> bytes:
    """A ``_payload`` result as one bytes object (its buffers in band)."""
    return packed if isinstance(packed, bytes) else pickle.dumps(packed, protocol=pickle.HIGHEST_PROTOCOL)


def dumps(value: Any) -> bytes:
    """Pickle ``value`` like nnsight's ``dumps_compact``, plain tensors packed per dtype (on the CPU)."""
    return _bytes(_payload(value))


class Packed:
    """A return value Ray serializes with ``dumps``; unpickles as the value itself.

    Falls back to Ray's own serializer (cloudpickle) for what plain pickle
    cannot write, such as a class defined in a caller's ``__main__``.
    """

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __reduce_ex__(self, protocol: int) -> Any:
        # The buffers are PickleBuffers: Ray (protocol 5) writes them out of band,
        # straight into its object store, instead of into the pickle stream.
        # Older protocols cannot hold a PickleBuffer: there the payload goes as bytes.
        try:
            packed = _payload(self.value)
        except Exception:
            return _identity, (self.value,)
        if isinstance(packed, bytes) or protocol < 5:
            return pickle.loads, (_bytes(packed),)
        return packed.__reduce__()


def _identity(value: Any) -> Any:
    return value


@contextmanager
def _collect_serializer(serialize: Any) -> Iterator[None]:
    """Within: nnsight's ``collect_nnsight`` serializes what it collected with ``serialize``.

    nnsight 0.8.1 pickles at the end of ``collect_nnsight`` with
    ``dumps_compact``, a global of its runner module; the one seam is to bind
    that name for the call. Only a rank's worker thread runs
    ``collect_nnsight``, one call at a time, so no other caller sees the swap.
    A swap already in place (an outer call's) is kept. Can go when nnsight
    separates collecting from serializing.
    """
    from nnsight.modeling.vllm.collect import dumps_compact as nnsights
    from nnsight.modeling.vllm.model_runners import GPUModelRunner as runner_module

    original = runner_module.dumps_compact
    if original is not nnsights:  # an outer call chose already
        yield
        return
    runner_module.dumps_compact = serialize
    try:
        yield
    finally:
        runner_module.dumps_compact = original


@contextmanager
def collect_filter(transform: Any) -> Iterator[None]:
    """Within: what nnsight's ``collect_nnsight`` collected passes through ``transform`` before it is serialized.

    Inside whichever serializer an outer call chose (``packed``, ``unserialized``): the
    filter wraps the one in place, so a runner mixin below ``PackedCollectRunnerMixin``
    sees every request's entry before any of it is pickled or stashed.
    """
    from nnsight.modeling.vllm.model_runners import GPUModelRunner as runner_module

    original = runner_module.dumps_compact
    runner_module.dumps_compact = lambda collected: original(transform(collected))
    try:
        yield
    finally:
        runner_module.dumps_compact = original


def unserialized() -> Any:
    """Within: nnsight's ``collect_nnsight`` returns its dict instead of pickling it (a rank's stash)."""
    return _collect_serializer(_identity)


def packed() -> Any:
    """Within: nnsight's ``collect_nnsight`` pickles with ``dumps`` (one buffer per dtype) instead of
    ``dumps_compact`` (``torch.save`` per tensor); the bytes load with plain ``pickle.loads``."""
    return _collect_serializer(dumps)


def collect_serializer() -> Any:
    """What ``collect_nnsight`` serializes with now (nnsight's ``dumps_compact`` unless swapped)."""
    from nnsight.modeling.vllm.model_runners import GPUModelRunner as runner_module

    return runner_module.dumps_compact


class PackedCollectRunnerMixin:
    """Runner mixin: what a runner's ``collect_nnsight`` returns is packed (``packed``), unless an outer call
    chose otherwise (a rank's stash keeps the dict: ``unserialized``). LocalVLLM's engine and nnsight's own
    driver code read it with ``pickle.loads``, as they read nnsight's bytes."""

    def collect_nnsight(self, *args: Any, **kwargs: Any) -> Any:
        with packed():
            return super().collect_nnsight(*args, **kwargs)  # type: ignore[misc]
