"""``NNsightEngineProcessorConfig``: Ray Data LLM's processor config, with an intervention.

A subclass of Ray Data LLM's offline processor config (``model_source``,
``batch_size``, ``concurrency``, ``should_continue_on_error``,
``max_concurrent_batches``, ``runtime_env``, ``accelerator_type``, ...), so
``ray.data.llm.build_processor`` takes it like its own (``processor``
registers the builder). What it adds is what the batch config has:
``engine_kwargs`` (vLLM's arguments, as they are), and exactly one of
``saves`` (``[{location, tokens}]``, the batch config's ``SaveSpec``) or
``intervention`` (``intervene(model, tracer) -> dict``: a callable, or a
``.py`` file defining it), or ``activations`` (every prompt token's rows at
some module outputs, written by the engine's ranks as token-major
safetensors files; each output row names its files). ``engine_name``
connects the actors to running ``RayVLLM`` deployments instead of starting
an engine each (as Ray Data LLM's ``ServeDeploymentProcessorConfig`` sends
rows to a running Serve deployment).

Validation here is of shapes and values only, so a config is checked in
microseconds anywhere; what needs vLLM (engine argument names, locations on the
model's tree) is checked by ``build_processor``'s preflight, before any engine
starts.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from ray.llm._internal.batch.processor.base import OfflineProcessorConfig

from ..batch.config import SaveSpec, refuse_reserved

__all__ = ["ActivationSpec", "NNsightEngineProcessorConfig", "SaveSpec"]

# Engine arguments this stage owns, with where the choice is made instead.
_RESERVED_ENGINE_KWARGS = {
    "model": "model_source",
    "distributed_executor_backend": "(nnsight_ray chooses: in the actor for one batch at a time at TP x PP = 1, "
                                    "its rank actors otherwise)",
    "placement_strategy": "placement_group_config's 'strategy'",
    "cpus_per_rank": "num_cpus, or placement_group_config's bundles with rank actors",
    "gpus_per_rank": "num_gpus, or placement_group_config's bundles with rank actors",
    "placement_group": "placement_group_config (each engine actor reserves its own group)",
    "placement_group_id": "placement_group_config (each engine actor reserves its own group)",
    "name": "(each engine actor names its own engine)",
    "detached": "(an engine lives as long as its actor)",
}
# Ray Data LLM's CPU stages around the engine. This engine stage reads `prompt` (or `tokenized_prompt`)
# and detokenizes itself; the others are not wired up yet.
_STAGES = ("chat_template_stage", "tokenize_stage", "detokenize_stage", "prepare_multimodal_stage")


class ActivationSpec(BaseModel):
    """An activation dataset: the ranks write every prompt token's rows at ``locations`` into ``dir``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    dir: str = Field(min_length=1, description="Folder the writing ranks write the safetensors files into: a local "
                     "path every node that runs a writing rank sees (shared storage across nodes); made absolute.")
    locations: list[str] = Field(min_length=1, description="Module outputs to keep at every token "
                                 "('model.layers.4.output'); one [rows, hidden] tensor each.")
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        "auto", description="The stored dtype; auto keeps the one the model computed in.")
    generated: bool = Field(False, description="Every generated token's row too (sampling_params.max_tokens > 1).")
    fsync: bool = Field(False, description="Flush each file to disk before it counts (survives a machine crash).")

    @field_validator("dir")
    @classmethod
    def _local_dir(cls, value: str) -> str:
        if "://" in value:
            raise ValueError(f"activations.dir {value!r}: the ranks write local files; give a path (shared storage "
                             "mounted at the same path on every node across nodes)")
        return str(Path(value).expanduser().resolve())

    @field_validator("locations")
    @classmethod
    def _module_outputs(cls, value: list[str]) -> list[str]:
        checked = []
        for location in value:
            try:
                spec = SaveSpec(location=location, tokens="all")
            except ValueError:
                spec = None
            if spec is None or spec.location == "logits" or spec.attribute != "output":
                raise ValueError(f"activations.locations: {location!r} is not '<module>.output' (activation "
                                 "datasets keep module outputs; use `saves` for anything else)")
            if spec.location in checked:
                raise ValueError(f"activations.locations: {spec.location!r} is listed twice")
            checked.append(spec.location)
        return checked


def needs_rank_actors(world_size: int, activations: bool, batches_in_flight: int) -> bool:
    """Whether an engine a Ray Data actor starts is a ``RayVLLM`` of rank actors in the actor's placement group
    (see ``NNsightEngineProcessorConfig.rank_actors``): several ranks, an activation dataset, or several batches
    in flight on one actor."""
    return world_size > 1 or activations or batches_in_flight > 1


class NNsightEngineProcessorConfig(OfflineProcessorConfig):
    """Ray Data LLM's vLLM processor config, plus the saves or the intervention each row runs.

    Example::

        config = NNsightEngineProcessorConfig(
            model_source="/models/llama", engine_kwargs={"max_model_len": 2048},
            concurrency=1, batch_size=16,
            saves=[{"location": "model.layers.1.output", "tokens": "last"}])
    """

    engine_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="vLLM engine arguments, as they are (LocalVLLM's keywords)."
    )
    saves: list[SaveSpec] | None = Field(
        None, description="Values to save per row, each a column: [{location, tokens}] (or use `intervention`)."
    )
    intervention: str | Callable[..., Any] | None = Field(
        None, description="intervene(model, tracer) -> {name: value}, each name a column: a callable, "
        "or a .py file defining `intervene`."
    )
    activations: ActivationSpec | None = Field(
        None, description="Instead of saves/intervention: an activation dataset the engine's ranks write "
        "({dir, locations, dtype, generated, fsync}); each row names its files (activation_files, "
        "activation_index, activation_rows)."
    )
    engine_name: str | list[str] | None = Field(
        None, description="Connect to running RayVLLM deployments by name (RayVLLM(..., name=...), "
        "RayVLLM.start_many) instead of starting an engine per actor: each actor attaches to every named engine "
        "and sends each batch to the one with the fewest of its batches in flight. The engines outlive the "
        "pipeline; model_source names the model they serve (checked at connect); engine_kwargs, num_gpus and "
        "placement_group_config do not apply."
    )
    num_cpus: float = Field(1.0, ge=0, description="CPUs Ray reserves for each engine actor.")
    num_gpus: float | None = Field(
        None, ge=0, description="GPUs Ray reserves for each engine actor (each rank, with rank actors); "
        "default 1 with accelerator_type, else 0."
    )
    placement_group_config: dict[str, Any] | None = Field(
        None, description="Rank actors only (see rank_actors): each engine's placement group, as Ray Data LLM's vLLM "
        "config takes it: "
        "{'bundle_per_worker': {...}} (one per rank) or {'bundles': [...]}, and 'strategy' (default PACK). "
        "Default: one bundle of 1 CPU and num_gpus GPUs per rank."
    )
    log_engine_metrics: bool = Field(
        True, description="Export vLLM's engine metrics (requests running and waiting, KV-cache use, time to first "
        "token, tokens per step, ...) through Ray's metrics export port, as Ray Data LLM's vLLM config does: vLLM's "
        "statistics are turned on (engine_kwargs disable_log_stats=False unless set) for the engines this pipeline "
        "starts as rank actors. Running engines (engine_name) keep their own setting; an engine in the actor "
        "(one batch at a time at TP x PP = 1) exports none."
    )
    # Ray Data LLM's defaults are True; the engine stage here reads `prompt` and returns `generated_text`.
    chat_template_stage: Any = Field(False, description="Not supported yet: give `prompt` in preprocess.")
    tokenize_stage: Any = Field(False, description="Not supported yet: the engine tokenizes `prompt`.")
    detokenize_stage: Any = Field(False, description="Not needed: `generated_text` comes from the engine.")
    prepare_multimodal_stage: Any = Field(False, description="Not supported.")

    @field_validator("engine_kwargs")
    @classmethod
    def _engine_kwargs(cls, value: dict[str, Any]) -> dict[str, Any]:
        refuse_reserved(value, _RESERVED_ENGINE_KWARGS)
        for key in ("tensor_parallel_size", "pipeline_parallel_size"):
            if key in value and (not isinstance(value[key], int) or isinstance(value[key], bool) or value[key] < 1):
                raise ValueError(f"engine_kwargs.{key}={value[key]!r}: expected a positive integer")
        return value

    @field_validator("engine_name")
    @classmethod
    def _engine_names(cls, value: str | list[str] | None) -> list[str] | None:
        if value is None:
            return None
        names = [value] if isinstance(value, str) else list(value)
        if not names or not all(isinstance(name, str) and name for name in names):
            raise ValueError(f"engine_name={value!r}: expected a deployment name or a non-empty list of them")
        if len(set(names)) != len(names):
            raise ValueError(f"engine_name: {sorted(n for n in set(names) if names.count(n) > 1)} listed twice")
        return names

    @field_validator("placement_group_config")
    @classmethod
    def _placement_group_config(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is None:
            return None
        from ray.llm._internal.common.placement import PlacementGroupConfig

        checked = PlacementGroupConfig(**value).model_dump(exclude_none=True)
        return checked

    @field_validator(*_STAGES)
    @classmethod
    def _stage_off(cls, value: Any, info: Any) -> Any:
        enabled = value.get("enabled", True) if isinstance(value, dict) else getattr(value, "enabled", value)
        if enabled:
            raise ValueError(f"{info.field_name}: not supported by nnsight_ray.data yet; have preprocess return "
                             "`prompt` (text) or `tokenized_prompt` (token ids) and `sampling_params`")
        return value

    @field_validator("max_pending_requests")
    @classmethod
    def _no_pending_limit(cls, value: int | None) -> int | None:
        if value is not None:
            raise ValueError("max_pending_requests: not used by nnsight_ray.data (each batch is one trace of "
                             "batch_size requests); tune batch_size and max_concurrent_batches")
        return value

    @field_validator("intervention")
    @classmethod
    def _intervention(cls, value: Any) -> Any:
        if isinstance(value, str):
            if Path(value).suffix != ".py":
                raise ValueError(f"{value!r} should be a .py file defining intervene(model, tracer)")
        elif value is not None:
            check_intervene(value)
        return value

    @model_validator(mode="after")
    def _saves_or_intervention(self) -> "NNsightEngineProcessorConfig":
        if bool(self.saves) + (self.intervention is not None) + (self.activations is not None) != 1:
            raise ValueError(
                "give exactly one of `saves` (a list of {location, tokens}), `intervention` "
                "(intervene(model, tracer) or a .py file) or `activations` ({dir, locations, ...}); got "
                f"saves={'set' if self.saves else 'empty'}, intervention={self.intervention!r} and "
                f"activations={'set' if self.activations else None}"
            )
        seen: set[str] = set()
        for spec in self.saves or []:
            if spec.location in seen:
                raise ValueError(f"saves: {spec.location!r} is listed twice")
            seen.add(spec.location)
        if self.engine_name is not None:
            given = [name for name, unset in (("engine_kwargs", not self.engine_kwargs),
                                              ("num_gpus", not self.num_gpus),
                                              ("placement_group_config", self.placement_group_config is None))
                     if not unset]
            if given:
                raise ValueError(f"{', '.join(given)}: a connected engine (engine_name={self.engine_name}) was "
                                 "started with its own settings and placement; leave these out")
        elif not self.rank_actors:
            if self.placement_group_config is not None:
                raise ValueError("placement_group_config: for engines of rank actors only (TP x PP > 1, activation "
                                 "datasets, or max_concurrent_batches > 1); an engine of one rank taking one batch at "
                                 "a time runs in its actor, which num_cpus and num_gpus size")
        else:
            bundles, _ = self.rank_bundles()
            if not any(bundle.get("CPU", 0.0) >= self.num_cpus for bundle in bundles):
                raise ValueError(f"num_cpus={self.num_cpus}: the engine actor runs in one of its placement group's "
                                 f"bundles, and none has that many CPUs ({bundles}); lower num_cpus or give a "
                                 "bundle more CPUs in placement_group_config")
        return self

    @property
    def columns(self) -> list[str]:
        """The save columns (``saves``' locations); an intervention's are the names it returns."""
        return [spec.location for spec in self.saves or []]

    def gpus(self) -> float:
        """GPUs per engine actor (per rank with rank actors): as set; else 1 with an ``accelerator_type``, 0 without."""
        if self.num_gpus is not None:
            return self.num_gpus
        return 1.0 if self.accelerator_type else 0.0

    def started_engine_kwargs(self) -> dict[str, Any]:
        """``engine_kwargs`` for an engine this pipeline starts: with vLLM's statistics on where
        ``log_engine_metrics`` exports them (rank actors: the engine actor installs Ray's stat logger)."""
        kwargs = dict(self.engine_kwargs)
        if self.log_engine_metrics and self.rank_actors:
            kwargs.setdefault("disable_log_stats", False)
        return kwargs

    @property
    def rank_actors(self) -> bool:
        """Whether each engine is a ``RayVLLM`` whose ranks are actors in the engine actor's placement group:
        at TP x PP > 1; for activation datasets (only rank actors write their files); and whenever an actor
        takes several batches at once (``max_concurrent_batches > 1``, the default 8), because a ``RayVLLM``
        runs their traces together in its engine while an engine in the actor (nnsight's blocking trace) runs
        one trace at a time. A connected engine (``engine_name``) is placed already: its actors take no group."""
        return self.engine_name is None and needs_rank_actors(self.world_size, self.activations is not None,
                                                              self.max_concurrent_batches)

    @property
    def engine_names(self) -> list[str] | None:
        """``engine_name`` as a list (None: each actor starts its own engine)."""
        return list(self.engine_name) if self.engine_name is not None else None

    @property
    def world_size(self) -> int:
        """Ranks per engine: ``tensor_parallel_size x pipeline_parallel_size``."""
        kwargs = self.engine_kwargs
        return int(kwargs.get("tensor_parallel_size") or 1) * int(kwargs.get("pipeline_parallel_size") or 1)

    def rank_bundles(self) -> tuple[list[dict[str, float]], str]:
        """Rank actors only: each engine's placement group, its bundles and strategy (``placement.rank_bundles``)."""
        from .placement import rank_bundles

        return rank_bundles(self.world_size, self.placement_group_config, self.gpus(), self.accelerator_type)


def check_intervene(intervene: Any) -> None:
    """Raise ``ValueError`` unless ``intervene`` can be called as ``intervene(model, tracer)``."""
    if not callable(intervene):
        raise ValueError(f"intervention: expected a callable or a .py path, got {type(intervene).__name__}")
    try:
        signature = inspect.signature(intervene)
    except (TypeError, ValueError):
        return  # a builtin or C callable: it may still take two arguments
    try:
        signature.bind(None, None)
    except TypeError:
        name = getattr(intervene, "__name__", type(intervene).__name__)
        raise ValueError(f"intervention: {name}{signature} cannot be called as intervene(model, tracer)") from None
