"""The wire format: what one stage hands the next, inside vLLM's ``IntermediateTensors``.

Two ``uint8`` tensors: `KEY` the pickled `StageMessage` (a CPU tensor, which
vLLM sends over its CPU group) and `KEY_DATA` the recorded tensors' raw bytes
on their own device.
"""

from __future__ import annotations

import io
import math
import pickle
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from .ghosts import Ghost

#: The ``IntermediateTensors`` keys the recordings travel under between stages.
KEY = "nnsight_pp"
KEY_DATA = "nnsight_pp.data"


@dataclass
class StageMessage:
    """What stages ``0..k`` hand stage ``k+1`` for one step.

    Attributes:
        order: Every location stages ``0..k`` handled this step, in order (codes).
        values: ``(block key, provider code, occurrence)`` -> the values
            served to that block there, in the order it read them.
        stopped: Block key -> why that block's copy on an earlier stage ended.
    """

    order: list = field(default_factory=list)
    values: dict = field(default_factory=dict)
    stopped: dict = field(default_factory=dict)


class Unsendable:
    """A recorded value that could not be pickled; serving it raises."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


class _Written:
    """Recorded where the owning stage applied a block's swap or skip (no value travels)."""

    def __reduce__(self) -> Any:
        return (_written, ())


def _written() -> "_Written":
    return WRITTEN


WRITTEN = _Written()


_ALIGN = 16


class _Packer(pickle.Pickler):
    """Pickles a message with its tensors moved out into one flat byte buffer.

    Pickling a tensor the ordinary way costs a few hundred microseconds each
    (storage reduction); a decode step's recordings are a handful of one-row
    tensors, so that cost would dominate. Each tensor is instead written as raw
    bytes at an aligned offset of one ``uint8`` buffer on the tensors' own
    device, and the pickle carries only ``(offset, dtype, shape)``.
    """

    def __init__(self, file: Any) -> None:
        super().__init__(file, protocol=5)
        self.chunks: list[torch.Tensor] = []
        self.size = 0
        self.device: Any = None

    def persistent_id(self, obj: Any) -> Any:
        if not isinstance(obj, torch.Tensor) or isinstance(obj, Ghost):
            return None
        flat = obj.detach().contiguous().reshape(-1).view(torch.uint8)
        if self.device is None:
            self.device = flat.device
        flat = flat.to(self.device)
        offset = self.size
        self.chunks.append(flat)
        pad = (-flat.numel()) % _ALIGN
        if pad:
            self.chunks.append(torch.zeros(pad, dtype=torch.uint8, device=flat.device))
        self.size += flat.numel() + pad
        return ("t", offset, obj.dtype, tuple(obj.shape))


class _Unpacker(pickle.Unpickler):
    def __init__(self, file: Any, data: Optional[torch.Tensor]) -> None:
        super().__init__(file)
        self.data = data

    def persistent_load(self, pid: Any) -> Any:
        _, offset, dtype, shape = pid
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        return self.data[offset : offset + nbytes].view(dtype).view(shape)


def _pad_bytes(body: bytes, tp_size: int) -> torch.Tensor:
    """``body`` with its length in front, padded so the length is not a multiple of ``tp_size``.

    vLLM splits a tensor whose size divides the tensor-parallel size across
    those ranks and all-gathers it on arrival, which would splice the pieces of
    every rank's own copy.
    """
    size = 8 + len(body)
    pad = (1 - size) % tp_size if tp_size > 1 else 0
    return torch.frombuffer(bytearray(len(body).to_bytes(8, "little")) + body + bytes(pad), dtype=torch.uint8)


def encode_message(message: StageMessage, tp_size: int = 1) -> dict[str, torch.Tensor]:
    """``message`` as the intermediate tensors vLLM sends between stages.

    ``KEY`` holds the pickled structure (a CPU ``uint8`` tensor, which vLLM
    sends over its CPU group) and ``KEY + ".data"`` the recorded tensors' bytes,
    on their own device. A recorded value that does not pickle travels as a
    marker that fails the block that needs it, not the engine.
    """
    state = {"order": message.order, "values": message.values, "stopped": message.stopped}
    buffer = io.BytesIO()
    packer = _Packer(buffer)
    try:
        packer.dump(state)
    except Exception:
        values = {key: list(entries) for key, entries in message.values.items()}
        for entries in values.values():
            for i, value in enumerate(entries):
                try:
                    _Packer(io.BytesIO()).dump(value)
                except Exception as exc:
                    entries[i] = Unsendable(f"{type(exc).__name__}: {exc}")
        state["values"] = values
        buffer = io.BytesIO()
        packer = _Packer(buffer)
        packer.dump(state)
    packed = {KEY: _pad_bytes(buffer.getvalue(), tp_size)}
    if packer.chunks:
        data = torch.cat(packer.chunks)
        if tp_size > 1 and data.numel() % tp_size == 0:
            data = torch.cat([data, data.new_zeros(1)])
        packed[KEY_DATA] = data
    return packed


def decode_message(meta: torch.Tensor, data: Optional[torch.Tensor] = None) -> StageMessage:
    """The message `encode_message` packed; recorded tensors are views of ``data``."""
    raw = meta.detach().to("cpu").numpy().tobytes()
    size = int.from_bytes(raw[:8], "little")
    if data is not None and data.is_cpu:
        data = data.clone()  # a CPU receive may hand back a view of a reused shared-memory buffer
    state = _Unpacker(io.BytesIO(raw[8 : 8 + size]), data).load()
    return StageMessage(order=state["order"], values=state["values"], stopped=state["stopped"])
