"""What runs inside each prompt's invoke: the config's saves, or the user's ``intervene``.

Both become one callable ``fn(model, tracer) -> {name: value}`` that the
runner's trace body calls once per invoke. It runs where nnsight runs
interventions, in the engine's ranks, so:

- the saves reader (``read_saves``) is a module-level function of this
  package, pickled by reference; every rank has the package installed;
- a user's ``intervene`` is loaded from its file as a module that is *not*
  registered in ``sys.modules``, so cloudpickle ships it by value and nnsight's
  pickler sends its source (it need not exist on the ranks' nodes).

Residual stream: vLLM's Llama-family decoder layers return ``(hidden, residual)``
with the residual add deferred to the next layer's fused norm; their sum is
the residual stream after the layer (what HuggingFace's layer returns). A saved
``.output`` that is a pair of same-shape tensors is therefore saved as their
sum; any other tuple as its first element. Single tensors (GPT-2 blocks) are
saved as they are.

Locations are checked against nnsight's meta tree (``resolve_saves``) before
any engine starts, and read in model execution order whatever their order in
the config: nnsight refuses to read a module that has already run.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from .errors import BatchConfigError
from .._internal.blocks.module_paths import missing_module
from .._internal.extract.parts import residual_parts

if TYPE_CHECKING:
    import torch

    from .config import SaveSpec

__all__ = ["SaveRead", "load_intervention", "read_saves", "residual_parts", "resolve_saves", "run_intervention",
           "to_residual"]


@dataclass(frozen=True)
class SaveRead:
    """One resolved save: the column ``name`` and how to read it in the trace."""

    name: str
    module_path: str | None  # None: the logits
    attribute: str  # output | input | logits
    tokens: str  # last | all


# --------------------------------------------------------------------------- in the ranks


def to_residual(value: Any) -> Any:
    """A layer output as one tensor: a same-shape pair summed (residual stream), else the first item."""
    parts = residual_parts(value)
    return parts[0] + parts[1] if len(parts) == 2 else parts[0]


def read_saves(model: Any, tracer: Any, reads: Sequence[SaveRead]) -> dict[str, Any]:
    """The config's saves for the current invoke (``reads`` in execution order)."""
    values = {}
    for read in reads:
        if read.module_path is None:
            value = model.logits
        else:
            envoy = model
            for part in read.module_path.split("."):
                envoy = envoy[int(part)] if part.isdigit() else getattr(envoy, part)
            value = getattr(envoy, read.attribute)
        value = to_residual(value)
        if read.tokens == "last":
            value = value[-1]
        # A read is a view into the step's buffers, which the next step reuses.
        values[read.name] = value.detach().clone()
    return values


def run_intervention(model: Any, tracer: Any, intervene: Callable) -> dict[str, Any]:
    """Call a user's ``intervene`` and check it returned ``{name: value}``."""
    import torch

    values = intervene(model, tracer)
    if not isinstance(values, dict):
        raise TypeError(f"intervene() returned {type(values).__name__}; return a dict of name -> tensor")
    return {
        str(key): value.detach().clone() if isinstance(value, torch.Tensor) else value
        for key, value in values.items()
    }


# --------------------------------------------------------------------------- on the driver


def reader(reads: Sequence[SaveRead]) -> Callable[[Any, Any], dict[str, Any]]:
    return functools.partial(read_saves, reads=tuple(reads))


def resolve_saves(module: "torch.nn.Module", saves: Sequence["SaveSpec"]) -> tuple[SaveRead, ...]:
    """Check each location exists on the (meta) module tree; order them as the model runs."""
    names = [name for name, _ in module.named_modules()]
    position = {name: i for i, name in enumerate(names)}
    keyed = []
    for index, spec in enumerate(saves):
        path = spec.module_path
        if path is None:
            keyed.append((float(len(names) + 1), index, SaveRead(spec.location, None, "logits", spec.tokens)))
            continue
        _require_module(names, path, f"saves.{index}.location {spec.location!r}")
        if spec.attribute == "input":
            key = float(position[path])
        else:
            # A module's output is ready after all of its descendants ran.
            inside = [position[n] for n in names if n == path or n.startswith(path + ".")]
            key = max(inside) + 0.5
        keyed.append((key, index, SaveRead(spec.location, path, spec.attribute, spec.tokens)))
    return tuple(read for _, _, read in sorted(keyed, key=lambda item: item[:2]))


def _require_module(names: Sequence[str], path: str, where: str) -> None:
    problem = missing_module(names, path)
    if problem is not None:
        raise BatchConfigError(
            f"{where}: {problem}; paths follow nnsight's module tree of the vLLM model, e.g. 'model.layers.0.output'"
        )


def load_intervention(path: str | Path) -> tuple[Callable, str]:
    """``intervene`` from a user's file, and the file's sha256. Checks before any engine starts."""
    path = Path(path).expanduser().resolve()
    where = f"intervention {str(path)!r}"
    if not path.is_file():
        raise BatchConfigError(f"{where}: no such file")
    source = path.read_text()
    try:
        code = compile(source, str(path), "exec")
    except SyntaxError as error:
        line = (error.text or "").rstrip()
        raise BatchConfigError(
            f"{where}: syntax error at line {error.lineno}: {error.msg}" + (f"\n    {line}" if line else "")
        ) from None
    digest = hashlib.sha256(source.encode()).hexdigest()
    # Not registered in sys.modules: cloudpickle then ships `intervene` by value
    # (nnsight's pickler sends its source), so the ranks need no copy of the file.
    spec = importlib.util.spec_from_file_location(f"nnsight_ray_intervention_{digest[:12]}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        exec(code, module.__dict__)
    except Exception as error:
        raise BatchConfigError(f"{where}: running the file failed: {type(error).__name__}: {error}") from None
    intervene = module.__dict__.get("intervene")
    if not callable(intervene):
        defined = sorted(k for k, v in module.__dict__.items() if callable(v) and not k.startswith("_"))
        raise BatchConfigError(f"{where}: defines no function `intervene(model, tracer)` (callables found: {defined})")
    try:
        inspect.signature(intervene).bind(None, None)
    except TypeError:
        raise BatchConfigError(
            f"{where}: intervene{inspect.signature(intervene)} cannot be called as intervene(model, tracer)"
        ) from None
    return functools.partial(run_intervention, intervene=intervene), digest
