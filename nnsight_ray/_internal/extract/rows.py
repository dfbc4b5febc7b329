"""Which rows ``extract`` takes from a step, and a part file's rows in their order.

``row_index`` and ``capture``: the step's rows of a module's output, as one copy.
The rest is the commit's, pure logic over host tensors. A prompt's own rows arrive as one entry (the step
that ran its prompt); the rows of the tokens it generates (``generated=True``)
arrive one ``DecodeBlock`` per step for the whole part, and are sorted once, at
the commit, with tensor operations: the Python work is per step and per prompt,
not per row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch


def capture(output: Any, rows: "torch.Tensor | range", dtype: torch.dtype | None = None,
            into: Any = None) -> torch.Tensor:
    """``rows`` of a module output's residual stream (``parts.residual_parts``: what the
    batch pipeline's Parquet saves read), as a copy in ``dtype`` (default: the output's); each
    part is narrowed before the sum.

    ``rows`` is a ``range`` when the step's captured rows are one span (every request of the
    step asks for extraction, as in a dataset run): views of the span, then one copy, no index.
    ``into(shape, dtype)``, if given, makes the tensor the rows are computed into (the CPU
    build's ``host_buffer``): no intermediate copy.
    """
    from .parts import residual_parts

    span = isinstance(rows, range)
    parts = [part.narrow(0, rows.start, len(rows)) if span else part.index_select(0, rows)
             for part in residual_parts(output)]
    if into is not None:
        out = into(parts[0].shape, dtype or parts[0].dtype)
        if len(parts) == 2:
            return torch.add(parts[0], parts[1], out=out)
        return out.copy_(parts[0])
    if len(parts) == 2:
        taken = parts[0] + parts[1]
    else:
        taken = parts[0].clone() if span else parts[0]  # a view is copied; index_select already copied
    return taken if dtype is None or taken.dtype == dtype else taken.to(dtype)


def row_index(spans: list[tuple[int, int]], device: Any) -> "torch.Tensor | range":
    """The flattened-batch rows of ``spans`` (``(first row, count)`` in batch order) for ``capture``.

    One contiguous span is a ``range``. Otherwise an index tensor on ``device``, copied from
    pinned memory without waiting: a copy from pageable memory would wait for every kernel
    queued before it (the previous step's forward) on the thread that launches this one.
    """
    if spans and all(a + n == b for (a, n), (b, _) in zip(spans, spans[1:])):
        return range(spans[0][0], spans[-1][0] + spans[-1][1])
    rows = torch.cat([torch.arange(a, a + n, dtype=torch.long) for a, n in spans]) if spans \
        else torch.empty(0, dtype=torch.long)
    if torch.device(device).type == "cuda":
        return rows.pin_memory().to(device, non_blocking=True)
    return rows.to(device)


class StepRequest(NamedTuple):
    """One request's rows in a step's capture: where they start among the captured rows, how many, their
    token ids (None: a decode step's, read from the forward's own input ids), its extraction spec, and the
    position of its first row."""

    rid: str
    first: int
    count: int
    ids: list[int] | None
    spec: dict[str, Any]
    position: int


@dataclass
class DecodeBlock:
    """One step's generated-token rows of one part: each row's prompt index, position, token id and values."""

    index: torch.Tensor
    position: torch.Tensor
    ids: torch.Tensor
    values: dict[str, torch.Tensor]


def _prompts_once(entries: list[tuple[int, int, list[int], dict[str, torch.Tensor]]]) -> list[tuple]:
    """A part's prompt entries by prompt index, each prompt once (the first captured: a preempted
    request's recompute captures it again)."""
    first: dict[int, tuple] = {}
    for entry in entries:
        first.setdefault(entry[0], entry)
    return [first[index] for index in sorted(first)]


def generated_rows(blocks: list[DecodeBlock], prompt_lengths: dict[int, int]) -> dict[str, Any] | None:
    """A part's generated-token rows, one tensor per column, sorted by prompt index then position.

    ``blocks``: one per step that ran generating requests of the part. A position is kept once,
    from the first step that ran it, and a prompt's own positions are left to its prompt entry
    (``prompt_lengths``): a preempted request's recompute runs its prompt and generated tokens
    again in one step. Vectorized: the part's Python work is per step, not per row.
    """
    if not blocks:
        return None
    locations = sorted(set.intersection(*(set(b.values) for b in blocks)))
    index = torch.cat([b.index for b in blocks])
    position = torch.cat([b.position for b in blocks])
    # a stable sort on (index, position): among equal keys the first step's row comes first
    key = index * (int(position.max()) + 1) + position
    order = torch.sort(key, stable=True).indices
    key = key[order]
    keep = torch.ones_like(key, dtype=torch.bool)
    keep[1:] = key[1:] != key[:-1]
    if prompt_lengths:
        # indices are the dataset's (a part's may be in the millions): look up only the ones present
        present, which = torch.unique(index[order], return_inverse=True)
        lengths = torch.tensor([prompt_lengths.get(int(i), 0) for i in present.tolist()], dtype=torch.int64)
        keep &= position[order] >= lengths[which]
    order = order[keep]
    rows = {"index": index[order], "position": position[order],
            "token_ids": torch.cat([b.ids for b in blocks]).to(torch.int64)[order]}
    # Each block's values copied once, straight to their sorted rows (not concatenated, then gathered).
    to = torch.full((len(index),), -1, dtype=torch.int64)
    to[order] = torch.arange(len(order))
    targets = []  # per block: its rows' places, and which rows are kept (None: all)
    for dest in to.split([len(b.index) for b in blocks]):
        taken = dest >= 0  # dropped: a recompute's repeat of a kept row, or a prompt's own position
        targets.append((dest, None) if bool(taken.all()) else (dest[taken], taken))
    for location in locations:
        first = blocks[0].values[location]
        out = rows[location] = first.new_empty((len(order), *first.shape[1:]))
        for block, (dest, taken) in zip(blocks, targets):
            values = block.values[location]
            out.index_copy_(0, dest, values if taken is None else values[taken])
    return rows


def part_columns(entries: list[tuple[int, int, list[int], dict[str, torch.Tensor]]], blocks: list[DecodeBlock],
                 ) -> tuple[dict[str, list[torch.Tensor]], list[int], list[int], list[str], int]:
    """A part's file columns (each a list of pieces, concatenated as written), its prompt indices in
    order, each one's row count, its locations, and how many captured rows were not written because
    another capture of their position was (a preempted request's recompute)."""
    ordered = _prompts_once(entries)
    generated = generated_rows(blocks, {index: len(ids) for index, _, ids, _ in ordered})
    pieces: dict[int, list[tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]]] = {}
    for index, position, ids, values in ordered:  # (token ids, positions, values) of each prompt, in order
        pieces.setdefault(index, []).append((torch.tensor(ids, dtype=torch.int64),
                                             torch.arange(position, position + len(ids), dtype=torch.int64),
                                             values))
    if generated is not None:
        indices, counts = torch.unique_consecutive(generated["index"], return_counts=True)
        start = 0
        for index, count in zip(indices.tolist(), counts.tolist()):
            pieces.setdefault(index, []).append((
                generated["token_ids"][start:start + count], generated["position"][start:start + count],
                {loc: v[start:start + count] for loc, v in generated.items()
                 if loc not in ("index", "position", "token_ids")}))
            start += count
    order = sorted(pieces)
    locations = sorted({loc for index in order for _, _, values in pieces[index] for loc in values})
    columns: dict[str, list[torch.Tensor]] = {loc: [] for loc in locations}
    tokens, positions, counts = [], [], []
    for index in order:
        counts.append(sum(len(ids) for ids, _, _ in pieces[index]))
        for ids, at, values in pieces[index]:
            tokens.append(ids)
            positions.append(at)
            for loc in locations:
                columns[loc].append(values[loc])
    columns["token_ids"] = [torch.cat(tokens) if tokens else torch.zeros(0, dtype=torch.int64)]
    columns["prompt_index"] = [torch.repeat_interleave(torch.tensor(order, dtype=torch.int64),
                                                       torch.tensor(counts, dtype=torch.int64))]
    columns["position"] = [torch.cat(positions) if positions else torch.zeros(0, dtype=torch.int64)]
    captured = sum(len(ids) for _, _, ids, _ in entries) + sum(len(b.index) for b in blocks)
    return columns, order, counts, locations, captured - sum(counts)
