"""The activation files' format: safetensors written piece by piece from host buffers, and checked whole."""

from __future__ import annotations

import math
import os
from typing import Any

import torch

FORMAT = "nnsight_ray.activations/1"
_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64",
                       torch.int32: "I32"}


def write_safetensors(path: str, columns: dict[str, list[torch.Tensor]], metadata: dict[str, str],
                      fsync: bool = True) -> None:
    """A safetensors file whose tensor ``name`` is ``columns[name]`` concatenated along dim 0.

    Written piece by piece from the host buffers the rows were copied into:
    no concatenation, no second copy (``safetensors.torch.save_file`` would
    make both). The format is the header length (8 bytes, little endian), a
    JSON header padded to 8 bytes, then each tensor's bytes in header order.
    """
    import json
    import struct

    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, pieces in columns.items():
        first = pieces[0]
        rows = sum(int(p.shape[0]) for p in pieces)
        size = rows * math.prod(first.shape[1:]) * first.element_size()
        header[name] = {"dtype": _SAFETENSORS_DTYPES[first.dtype], "shape": [rows, *first.shape[1:]],
                        "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(encoded)))
        handle.write(encoded)
        for pieces in columns.values():
            for piece in pieces:
                piece = piece.contiguous()
                if piece.numel():
                    # bytes as they are (numpy has no bfloat16): a view, written without a copy
                    handle.write(memoryview(piece.view(torch.uint8).numpy() if piece.dim() else piece.numpy()))
        handle.flush()
        if fsync:
            os.fsync(handle.fileno())


def safetensors_complete(path: str) -> bool:
    """Whether a safetensors file is as long as its header says (a crash without fsync can cut one short)."""
    import json
    import struct

    try:
        with open(path, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        return os.path.getsize(path) == 8 + length + end
    except (OSError, ValueError, KeyError, struct.error):
        return False
