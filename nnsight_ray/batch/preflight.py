"""A batch run's preflight: every input checked before any engine starts (no Ray).

``prepare`` reads the prompts, loads the intervention file or resolves every
save location on nnsight's meta tree of the model (built from the config only,
no weights), checks the engine arguments against vLLM's and the taps against the tree, builds the tiny test
model if asked, and refuses an output folder it cannot write or one written
from other inputs. Every mistake a
config can hold fails here, in seconds, with the key or file named.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from .config import BatchConfig
from .errors import BatchConfigError
from .interventions import SaveRead, load_intervention, reader, resolve_saves
from .prompts import Prompt, file_digest, read_prompts
from .run_dir import RunDir, check_writable

logger = logging.getLogger(__name__)

__all__ = ["Prepared", "prepare"]

# RayVLLM options that may ride engine_kwargs besides vLLM's own arguments.
_RAYVLLM_OPTIONS = {"placement_timeout_s", "cpu_binding", "num_merge_actors", "taps", "early_ranks"}


@dataclass
class Prepared:
    """Everything a run needs, checked; no engine, no Ray."""

    config: BatchConfig
    config_file: str | None
    model_path: str
    prompts: list[Prompt]
    fn: Callable[[Any, Any], dict[str, Any]]
    reads: tuple[SaveRead, ...]
    run_dir: RunDir
    previous: dict[str, Any] | None


def prepare(config: BatchConfig, config_file: str | None = None, resolve: bool = True) -> Prepared:
    """Check every input of ``config`` before any engine starts.

    ``resolve=False`` skips what needs vLLM (building the model, the engine
    argument names, the meta tree): the cheap checks only.
    """
    source = config.prompts
    # A URI (s3://, hf://) is Ray Data's to read (batch.pipeline checks it once Ray is up); a local file is read here.
    prompts = [] if source.remote else read_prompts(_abs(source.path), source.id_field, source.text_field,
                                                    source.kind)
    check_writable(_abs(config.output.dir))
    if config.intervention:
        fn, code_digest = load_intervention(_abs(config.intervention))
    else:
        fn, code_digest = None, None
    model_path = _model_path(config) if resolve else str(config.model.path)
    reads: tuple[SaveRead, ...] = ()
    if resolve:
        _check_engine_kwargs(config.engine.engine_kwargs)
        module = _meta_module(model_path, config.engine.engine_kwargs)
        if config.saves:
            reads = resolve_saves(module, config.saves)
    if fn is None:
        fn = reader(reads)
    output = config.output
    fingerprint = {
        "model": {"path": model_path, "build_arch": config.model.build_arch},
        "prompts": {"sha256": source.path if source.remote else file_digest(_abs(source.path)),
                    "id_field": config.prompts.id_field,
                    "text_field": config.prompts.text_field, "count": len(prompts)},
        "saves": [s.model_dump() for s in config.saves] if config.saves else None,
        "intervention_sha256": code_digest,
        "sampling": config.sampling.model_dump(),
        "shard_size": config.output.shard_size,
        # "generated" only when set: folders written before it existed still resume.
        **({"format": "activations", "dtype": output.dtype, **({"generated": True} if output.generated else {})}
           if config.activations else {}),
    }
    run_dir = RunDir(_abs(config.output.dir), fingerprint)
    previous = run_dir.check_compatible()
    return Prepared(config, config_file, model_path, prompts, fn, reads, run_dir, previous)


def _abs(path: str) -> Path:
    return Path(path).expanduser().resolve()


def _model_path(config: BatchConfig) -> str:
    raw = config.model.path
    path = _abs(raw)
    if config.model.build_arch:
        from ..models import ensure_model

        if not path.exists() or not any(path.iterdir()):
            logger.info("building the tiny %s test model at %s", config.model.build_arch, path)
            ensure_model(path, arch=config.model.build_arch)
        elif (path / "nnsight_ray_model.json").exists():
            ensure_model(path, arch=config.model.build_arch)
        elif not (path / "config.json").exists():
            raise BatchConfigError(
                f"model.path {raw!r}: the folder exists, is not empty and holds no checkpoint (config.json); "
                "model.build_arch only builds into a missing or empty folder"
            )
        return str(path)
    if path.exists():
        return str(path)
    if re.fullmatch(r"[\w.-]+/[\w.-]+", raw) and not raw.startswith("."):
        return raw  # a hub id: vLLM resolves it (HF_HOME on every node)
    raise BatchConfigError(
        f"model.path {raw!r}: no such folder (from {Path.cwd()}); point it at a checkpoint, "
        "or set model.build_arch (llama|gpt2) to build the tiny test model there"
    )


def _check_engine_kwargs(kwargs: dict[str, Any]) -> None:
    from vllm.engine.arg_utils import EngineArgs

    from .._internal.ranks.limits import ENGINE_KEYS, engine_limits

    known = {f.name for f in dataclasses.fields(EngineArgs)} | _RAYVLLM_OPTIONS | set(ENGINE_KEYS)
    unknown = sorted(set(kwargs) - known)
    if unknown:
        import difflib

        hints = {k: difflib.get_close_matches(k, known, n=1) for k in unknown}
        described = ", ".join(f"{k!r}" + (f" (did you mean {hints[k][0]!r}?)" if hints[k] else "") for k in unknown)
        raise BatchConfigError(
            f"engine.engine_kwargs: unknown vLLM engine argument(s) {described}; "
            "see `vllm serve --help` (argument names with '_' for '-')"
        )
    from ..errors import RequestError
    from .._internal.blocks.graphs import engine_mode

    try:
        engine_mode(kwargs)  # enforce_eager / taps (CUDA graphs): contradictions are refused here
        engine_limits(kwargs)  # the tenant limits (block_timeout_s, max_save_bytes, ...)
    except (RequestError, ValueError) as error:
        raise BatchConfigError(f"engine.engine_kwargs: {error}") from None


def _meta_module(model_path: str, engine_kwargs: dict[str, Any]) -> Any:
    """nnsight's meta tree of the model (structure only, no weights, no engine); the engine's taps checked on it."""
    from nnsight.modeling.vllm import VLLM

    from ..local import LocalVLLM

    kwargs = {k: v for k, v in engine_kwargs.items() if k not in _RAYVLLM_OPTIONS}
    try:
        meta = LocalVLLM(model_path, **kwargs)
    except Exception as error:
        raise BatchConfigError(
            f"model.path {model_path!r}: vLLM could not build the model's structure: {type(error).__name__}: {error}"
        ) from error
    module = meta._module
    # The single-rank process group the meta build brought up would collide
    # with the next one (each RayVLLM client builds its own meta tree).
    if meta._owns_distributed:
        VLLM._cleanup_distributed()
    if taps := engine_kwargs.get("taps"):
        _check_taps(meta, list(taps))
    return module


def _check_taps(meta: Any, taps: list[str]) -> None:
    """Each tap names a module of the tree, and each operation inside a forward one that forward has."""
    from .._internal.blocks.graphs import open_sourced

    meta.taps = tuple(taps)
    try:
        open_sourced(meta, meta._resolve_taps(module=meta._module))
    except ValueError as error:
        raise BatchConfigError(f"engine.engine_kwargs.taps: {error}") from None
