"""A part file's rows in their order: each prompt's, then its generated tokens' (``extract``'s commit).

Pure logic over host tensors. A prompt's own rows arrive as one entry (the step
that ran its prompt); the rows of the tokens it generates (``generated=True``)
arrive one ``DecodeBlock`` per step for the whole part, and are sorted once, at
the commit, with tensor operations: the Python work is per step and per prompt,
not per row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


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
        lengths = torch.tensor([prompt_lengths.get(int(i), 0) for i in range(int(index.max()) + 1)],
                               dtype=torch.int64)
        keep &= position[order] >= lengths[index[order]]
    order = order[keep]
    rows = {"index": index[order], "position": position[order],
            "token_ids": torch.cat([b.ids for b in blocks]).to(torch.int64)[order]}
    for location in locations:
        rows[location] = torch.cat([b.values[location] for b in blocks]).index_select(0, order)
    return rows


def part_columns(entries: list[tuple[int, int, list[int], dict[str, torch.Tensor]]], blocks: list[DecodeBlock],
                 ) -> tuple[dict[str, list[torch.Tensor]], list[int], list[int], list[str]]:
    """A part's file columns (each a list of pieces, concatenated as written), its prompt indices in
    order, each one's row count, and its locations."""
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
    return columns, order, counts, locations
