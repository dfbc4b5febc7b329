"""Stage ownership: which pipeline stage runs which location (pure; unit-tested without an engine)."""

from __future__ import annotations

import pickle
import re
import types
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch

#: A location's owner when no single stage runs it (handled by every stage).
LOCAL = -1

_INDEXED = re.compile(r"^(?P<parent>.+)\.(?P<index>\d+)(?P<rest>(\..*)?)$")
_MODULE_LOCATIONS = ("input", "output", "skip")


@dataclass
class StageMap:
    """Which pipeline stage owns each location, as seen from one stage.

    Attributes:
        stage: This stage's index.
        num_stages: Pipeline size.
        owner: Provider -> owning stage, for every module location of the full
            tree plus ``{root}.logits`` / ``{root}.samples``.
        modules: Module path -> (input owner, output owner): different for a
            container whose children span stages, ``LOCAL`` for a path no
            stage really holds.
        later: Providers a later stage owns (counted once per step after the drain).
        names: Every provider, sorted: ``names[i]`` is code ``i`` on the wire.
        templates: Later provider -> this stage's sibling whose value has the
            same structure (layer ``i`` of a split list -> an own layer).
        missing: Module paths of the full tree this stage does not hold.
    """

    stage: int
    num_stages: int
    owner: dict[str, int]
    modules: dict[str, tuple[int, int]]
    later: tuple[str, ...]
    names: list[str]
    templates: dict[str, str]
    missing: list[str]
    codes: dict[str, int] = field(default_factory=dict)
    template_sources: frozenset = frozenset()
    _resolved: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.codes = {name: i for i, name in enumerate(self.names)}
        self.template_sources = frozenset(self.templates.values())

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    def owner_of(self, provider: str) -> int:
        """The stage that runs ``provider``, or `LOCAL` if each stage handles it itself.

        Locations outside the module map (``.source`` operations, ``result``)
        belong to the nearest enclosing module's body: its owner, or `LOCAL`
        inside a container that spans stages.
        """
        found = self.owner.get(provider)
        if found is not None:
            return found
        found = self._resolved.get(provider)
        if found is not None:
            return found
        found = LOCAL
        path = provider
        while "." in path:
            path = path.rsplit(".", 1)[0]
            span = self.modules.get(path)
            if span is not None:
                found = span[0] if span[0] == span[1] else LOCAL
                break
        self._resolved[provider] = found
        return found

    def code(self, provider: str) -> int | str:
        return self.codes.get(provider, provider)

    def name(self, code: int | str) -> str:
        return self.names[code] if isinstance(code, int) else code


def build_stage_map(stage: int, trees: list[dict[str, bool]], root: str = "model") -> StageMap:
    """Work out location ownership from every stage's module tree.

    ``trees[s]`` maps each module path stage ``s`` has to whether it is real
    there (``False`` for a ``PPMissingLayer`` placeholder). A module's home is
    the first stage where it is real; a module whose descendants live on
    several stages spans them: its ``.input``/``.skip`` belong to the first of
    those and its ``.output`` to the last. Pure, so it is unit-tested without
    an engine.
    """
    num_stages = len(trees)
    paths = sorted({path for tree in trees for path in tree})
    # Each module's home, handed up to every enclosing module (one pass).
    homes_of: dict[str, set] = {path: set() for path in paths}
    for path in paths:
        home = next((s for s, tree in enumerate(trees) if tree.get(path)), None)
        if home is None:
            continue
        ancestor = path
        while True:
            if ancestor in homes_of:
                homes_of[ancestor].add(home)
            if "." not in ancestor:
                break
            ancestor = ancestor.rsplit(".", 1)[0]

    modules: dict[str, tuple[int, int]] = {}
    for path in paths:
        homes = homes_of[path]
        if not homes:
            modules[path] = (LOCAL, LOCAL)
        elif len(homes) == 1:
            home = homes.pop()
            modules[path] = (home, home)
        else:
            modules[path] = (min(homes), max(homes))

    owner: dict[str, int] = {}
    for path, (first, last) in modules.items():
        owner[f"{path}.input"] = first
        owner[f"{path}.skip"] = first
        owner[f"{path}.output"] = last
    owner[f"{root}.logits"] = num_stages - 1
    owner[f"{root}.samples"] = num_stages - 1

    later = tuple(sorted(p for p, s in owner.items() if s > stage))

    # A later stage's layer has the structure of one this stage holds, when
    # both are entries of the same split list.
    templates: dict[str, str] = {}
    own_index: dict[str, int] = {}
    for path, (first, last) in modules.items():
        match = _INDEXED.match(path)
        if match and not match.group("rest") and first == last == stage:
            parent = match.group("parent")
            own_index[parent] = max(own_index.get(parent, -1), int(match.group("index")))
    for provider in later:
        loc, _, kind = provider.rpartition(".")
        match = _INDEXED.match(loc)
        if match and match.group("parent") in own_index:
            sibling = f"{match.group('parent')}.{own_index[match.group('parent')]}{match.group('rest')}.{kind}"
            if sibling in owner and owner[sibling] == stage:
                templates[provider] = sibling

    mine = trees[stage]
    missing = [path for path in paths if not mine.get(path)]
    return StageMap(
        stage=stage,
        num_stages=num_stages,
        owner=owner,
        modules=modules,
        later=later,
        names=sorted(owner),
        templates=templates,
        missing=missing,
    )


def module_tree(model: Any) -> dict[str, bool]:
    """This stage's module paths and whether each is real (not a vLLM ``PPMissingLayer``)."""
    from vllm.model_executor.models.utils import PPMissingLayer

    return {envoy.path: not isinstance(envoy._module, PPMissingLayer) for envoy in model.modules()}


class StageStub(torch.nn.Module):
    """Stands in for a module another pipeline stage holds, so blocks that name it deserialize here.

    ``body``: the forward of the module it stands for (``forward_templates``), which is what nnsight
    reads for its ``.source`` (``module_body``: an instance forward bound to the module), so a block's
    ``layers[0].self_attn.source.self_o_proj_0`` names the same operation on every stage; the owning
    stage serves the value and the others replay or ghost it, as for ``.output``. Never called here.
    """

    def __init__(self, path: str, body: Any = None) -> None:
        super().__init__()
        self.nnsight_pp_path = path
        if body is not None:
            self.forward = types.MethodType(body, self)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{self.nnsight_pp_path} runs on another pipeline stage, not this one")

    def extra_repr(self) -> str:
        return self.nnsight_pp_path


def forward_templates(modules: Iterable[tuple[str, Any]]) -> dict[tuple[str, str], Any]:
    """Per place in an indexed list (``("model.model.layers", ".self_attn")``), the class forward of the
    module this stage holds there, from ``(path, module)`` pairs (an envoy tree's, or ``named_modules()``):
    the ``body`` of a stand-in for the same place in an item another stage holds (``layers.0.self_attn`` on
    the stage that runs layers 2-3), and of a list's own placeholders (``lend_forwards``)."""
    from vllm.model_executor.models.utils import PPMissingLayer

    templates: dict[tuple[str, str], Any] = {}
    for path, module in modules:
        match = _INDEXED.match(path)
        if match and not isinstance(module, PPMissingLayer):
            templates.setdefault((match.group("parent"), match.group("rest")), type(module).forward)
    return templates


def own_forwards(model: torch.nn.Module) -> dict[str, bytes]:
    """This stage's modules outside indexed lists that it runs (the embedding, the final norm, the LM head on
    the stages that hold them), path -> its class forward pickled by reference (an importable class; others
    are not offered): what the other stages' placeholders there show (``lend_forwards``)."""
    from vllm.model_executor.models.utils import PPMissingLayer

    forwards: dict[str, bytes] = {}
    for path, module in model.named_modules():
        if path and not _INDEXED.match(path) and not isinstance(module, PPMissingLayer) \
                and type(module).forward is not torch.nn.Module.forward:  # a container: nothing to show
            try:
                forwards[path] = pickle.dumps(type(module).forward)
            except Exception:  # a class defined in a function: no reference to send
                continue
    return forwards


def _loaded(reference: bytes) -> Any:
    """A forward another stage offered, or None where this process cannot import it (that placeholder then
    keeps its own forward: a read of its ``.source`` fails there, the engine still starts)."""
    try:
        return pickle.loads(reference)
    except Exception:
        return None


def lend_forwards(model: torch.nn.Module, peers: Iterable[dict[str, bytes]] = ()) -> list[str]:
    """Give each vLLM ``PPMissingLayer`` placeholder the forward of the module it stands for, bound to it;
    return their paths.

    For an item of an indexed list (``layers.0`` on the stage that runs layers 2-3), the class forward of an
    item this stage runs; for any other (the final norm before the last stage), the forward the stage that
    runs it offers (``peers``: every stage's ``own_forwards``). Called between vLLM's load and nnsight's
    wrap, which reads a module's instance forward as its body (``module_body``): so ``layers[0].source``,
    ``norm.source`` and a ``.source.`` tap on a whole layer name the same operations on every stage
    (nnsight's tapped runner refuses to start otherwise: the placeholder's forward has none of them), and
    the owning stage's values reach the others as ``.output``'s do. Never called: vLLM runs only a stage's
    own slice of the list, and the modules of other stages only there.
    """
    from vllm.model_executor.models.utils import PPMissingLayer

    pairs = list(model.named_modules())
    templates = forward_templates(pairs)
    offered: dict[str, bytes] = {}
    for forwards in peers:
        for path, reference in forwards.items():
            offered.setdefault(path, reference)
    lent = []
    for path, module in pairs:
        if not isinstance(module, PPMissingLayer):
            continue
        match = _INDEXED.match(path)
        body = templates.get((match.group("parent"), match.group("rest"))) if match \
            else _loaded(offered[path]) if path in offered else None
        if body is not None:
            module.forward = types.MethodType(body, module)
            lent.append(path)
    return lent


class StagePersistentObjects(dict):
    """The runner's persistent-object map, answering for modules other stages hold.

    nnsight's unpickler asks ``pid in objects`` and then ``objects[pid]``; a
    ``Module:<path>`` this stage lacks resolves to a `StageStub`, built once,
    with the forward of its place's template (``forward_templates``) if there is one.
    """

    def __init__(self, objects: Any = (), templates: dict[tuple[str, str], Any] | None = None) -> None:
        super().__init__(objects)
        self.templates = templates or {}

    def __contains__(self, key: object) -> bool:
        return dict.__contains__(self, key) or (isinstance(key, str) and key.startswith("Module:"))

    def stand_in(self, path: str) -> StageStub:
        match = _INDEXED.match(path)
        return StageStub(path, self.templates.get((match.group("parent"), match.group("rest"))) if match else None)

    def __missing__(self, key: str) -> Any:
        if not (isinstance(key, str) and key.startswith("Module:")):
            raise KeyError(key)
        stub = self[key] = self.stand_in(key[len("Module:"):])
        return stub



def counted(taps: frozenset, provider: str) -> bool:
    """Whether nnsight counts a visit to ``provider``: on a CUDA-graph engine only taps are."""
    return not taps or provider in taps or provider.rsplit(".", 1)[-1] not in _MODULE_LOCATIONS
