"""Checks of a module path (``model.layers.0``) against a model's module tree, by name.

One rule for every place that takes a location from a user: the batch config's ``saves`` (checked on the
meta model before any engine starts) and ``extract_async``'s locations (checked against the module names
RayVLLM read from its meta model). A path is data: it is only ever compared with the tree's names.
"""

from __future__ import annotations

from collections.abc import Sequence


def missing_module(names: Sequence[str], path: str) -> str | None:
    """None when ``path`` is one of ``names`` (the dotted paths of a model's modules, in the model's order,
    as ``named_modules()`` gives them); else which part is missing, and what is there instead."""
    known = set(names)
    if path in known:
        return None
    walked = ""
    for part in path.split("."):
        here = f"{walked}.{part}" if walked else part
        if here not in known:
            children = [name.rpartition(".")[2] for name in names
                        if name and name.rpartition(".")[0] == walked]
            owner = f"'{walked}'" if walked else "the model"
            listing = ", ".join(children[:12]) + (", ..." if len(children) > 12 else "")
            return (f"{owner} has no submodule {part!r}"
                    + (f" (its children: {listing})" if children else " (it has no children)"))
        walked = here
    return None
