"""nnsight interventions on vLLM engines spread over a Ray cluster.

Public surface: ``LocalVLLM`` (nnsight's in-process ``VLLM`` on CPU or GPU,
optionally with Ray rank actors), ``build_model`` (tiny test checkpoints) and
the typed errors. Heavy imports (vllm, torch, ray) happen on first use.
"""

from __future__ import annotations

from typing import Any


def _define_anyio_attribute_sets() -> None:
    """Define anyio's ``TypedAttributeSet`` subclasses with nnsight's ``.save`` mount out of the way.

    nnsight 0.8.1 mounts ``save`` onto ``object`` when imported; anyio's
    ``TypedAttributeSet.__init_subclass__`` then rejects every attribute set
    defined later ("Attribute 'save' is missing its type annotation"). nnsight
    warms ``import anyio`` for this, but anyio >= 4.16 loads its submodules
    lazily, so ``SocketAttribute`` (``anyio.abc``), ``TLSAttribute`` and
    ``FileStreamAttribute`` stay undefined, and the first Starlette/Serve code
    touching them (a Serve replica, the HTTP proxy) fails. Ray worker processes
    are reused, so nnsight may already be imported when this package is: then
    the mount is lifted while anyio's classes are defined and put back (the
    same function, through nnsight's own ``mount``/``unmount``). Every process
    that unpickles one of our actors or deployments imports this package first.
    Remove when nnsight warms these itself.
    """
    import sys

    try:
        import anyio  # noqa: F401
    except ImportError:  # anyio is optional for the package itself
        return
    mounted = object.__dict__.get("save") if "nnsight" in sys.modules else None
    mount = unmount = None
    if mounted is not None:
        try:
            from nnsight._c import mount, unmount
        except ImportError:
            pass
        if unmount is not None:
            unmount("save")
    try:
        import anyio.streams.file  # noqa: F401
        import anyio.streams.tls  # noqa: F401
        from anyio.abc import SocketAttribute  # noqa: F401
    finally:
        if mounted is not None and mount is not None:
            mount(mounted, "save")


_define_anyio_attribute_sets()

__all__ = ["LocalVLLM", "RayVLLM", "build_model", "ensure_model", "errors"]


def __getattr__(name: str) -> Any:
    if name == "LocalVLLM":
        from .local import LocalVLLM

        return LocalVLLM
    if name == "RayVLLM":
        from .ray_vllm import RayVLLM

        return RayVLLM
    if name in ("build_model", "ensure_model"):
        from . import models

        return getattr(models, name)
    if name == "errors":
        from . import errors

        return errors
    raise AttributeError(f"module 'nnsight_ray' has no attribute {name!r}")
