"""The batch run's config: one YAML file, validated at the boundary.

The schema (agreed with ``cluster_configs/``; every section but ``model``,
``prompts`` and one of ``saves``/``intervention`` has defaults)::

    model:        {path, build_arch}
    engine:       {tensor_parallel_size, pipeline_parallel_size, placement_strategy,
                   cpus_per_rank, gpus_per_rank, replicas, engine_kwargs}
    prompts:      {path, format, id_field, text_field}
    saves:        [{location, tokens}]        # or
    intervention: path/to/file.py             # defines intervene(model, tracer) -> dict
    sampling:     {max_tokens, temperature}
    output:       {dir, shard_size, format, dtype, fsync, generated}   # format: parquet | activations
    runner:       {max_in_flight, prompts_per_trace, progress_interval_s}   # optional tuning

Unknown keys are refused with the allowed ones listed (a typo would otherwise
silently fall back to a default). Loading checks shapes and values only: files
named by the config are checked by the run's preflight
(``nnsight_ray.batch.preflight.prepare``), before any engine starts, so a config
can be validated on a machine that has none of them (CI, a laptop).

Overrides (``--set key.sub=value``) are applied to the parsed YAML before
validation; values are YAML (``1``, ``true``, ``null``, ``[a, b]``,
``{location: logits}``); a numeric segment indexes a list (``saves.0.tokens=all``).
"""

from __future__ import annotations

import difflib
import os
import typing
from pathlib import Path
from typing import Any, Literal, Sequence

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .._internal.cluster.placement import PlacementStrategy, RankPlacement
from .errors import BatchConfigError

__all__ = [
    "BatchConfig",
    "EngineConfig",
    "ModelConfig",
    "OutputConfig",
    "PromptsConfig",
    "RunnerConfig",
    "SamplingConfig",
    "SaveSpec",
    "apply_overrides",
    "load_config",
]

_PLACEMENT_FIELDS = ("placement_strategy", "cpus_per_rank", "gpus_per_rank")
PROMPT_SUFFIXES = (".jsonl", ".txt", ".parquet")
# Engine arguments the config's own keys own; in engine_kwargs they would be
# silently overridden or contradict the layout.
_RESERVED_ENGINE_KWARGS = {
    "model": "model.path",
    "tensor_parallel_size": "engine.tensor_parallel_size",
    "pipeline_parallel_size": "engine.pipeline_parallel_size",
    "distributed_executor_backend": "(set by nnsight_ray: ranks are Ray actors)",
    "placement_strategy": "engine.placement_strategy",
    "cpus_per_rank": "engine.cpus_per_rank",
    "gpus_per_rank": "engine.gpus_per_rank",
}


def refuse_reserved(engine_kwargs: dict[str, Any], reserved: dict[str, str]) -> dict[str, Any]:
    """``engine_kwargs`` as given, or a ValueError naming a key set elsewhere (``reserved``: key -> where)."""
    for key, owner in reserved.items():
        if key in engine_kwargs:
            raise ValueError(f"engine_kwargs.{key} is not allowed here; use {owner}")
    return engine_kwargs

class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelConfig(_Section):
    """The checkpoint every rank loads."""

    path: str = Field(min_length=1, description="Checkpoint folder or hub id; must resolve on every node.")
    build_arch: Literal["llama", "gpt2"] | None = Field(
        None, description="Build the project's seeded tiny test model of this architecture at `path` if missing."
    )


class EngineConfig(_Section):
    """The vLLM engine(s) and where their ranks run."""

    tensor_parallel_size: int = Field(1, ge=1, description="Ranks splitting each layer.")
    pipeline_parallel_size: int = Field(1, ge=1, description="Ranks splitting the layer stack.")
    # RankPlacement's own fields (one definition: type, default, bounds, description).
    placement_strategy: PlacementStrategy = RankPlacement.model_fields["placement_strategy"]
    cpus_per_rank: float = RankPlacement.model_fields["cpus_per_rank"]
    gpus_per_rank: float = RankPlacement.model_fields["gpus_per_rank"]
    replicas: int = Field(1, ge=1, description="Independent engines splitting the prompts.")
    engine_kwargs: dict[str, Any] = Field(default_factory=dict, description="vLLM engine arguments, as they are.")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def placement(self) -> RankPlacement:
        """Where each replica's ranks run, as ``RayVLLM`` takes it."""
        return RankPlacement(**{name: getattr(self, name) for name in _PLACEMENT_FIELDS})

    @field_validator("engine_kwargs")
    @classmethod
    def _no_layout_in_engine_kwargs(cls, value: dict[str, Any]) -> dict[str, Any]:
        return refuse_reserved(value, _RESERVED_ENGINE_KWARGS)


class PromptsConfig(_Section):
    """Where the prompts come from: a local file, or any path Ray Data reads (s3://, gs://, hf://datasets/...)."""

    path: str = Field(min_length=1, description="A .jsonl (one object per line), .txt (one prompt per line) or "
                      ".parquet file or folder; local, or a URI Ray Data reads (s3://, gs://, hf://datasets/...).")
    format: Literal["jsonl", "txt", "parquet"] | None = Field(
        None, description="The files' format; default: the path's suffix (give it for a folder or a URI without one).")
    id_field: str = Field("id", min_length=1, description="Field holding each prompt's id (.jsonl, .parquet).")
    text_field: str = Field("prompt", min_length=1, description="Field holding the prompt text (.jsonl, .parquet).")

    @model_validator(mode="after")
    def _known_format(self) -> "PromptsConfig":
        if self.format is None and Path(self.path).suffix.lower() not in PROMPT_SUFFIXES:
            raise ValueError(f"{self.path!r}: prompts must be one of {', '.join(PROMPT_SUFFIXES)} (by file suffix), "
                             "or set prompts.format (jsonl|txt|parquet)")
        return self

    @property
    def kind(self) -> str:
        """``jsonl``, ``txt`` or ``parquet``: ``format``, else the path's suffix."""
        return self.format or Path(self.path).suffix.lower().lstrip(".")

    @property
    def remote(self) -> bool:
        """A URI (``s3://...``, ``hf://...``): read by Ray Data only (the Ray Data path of the CLI)."""
        return "://" in self.path and not self.path.startswith("file://")


class SaveSpec(_Section):
    """One value to save per prompt: a module's output/input, or the logits."""

    location: str = Field(
        min_length=1,
        description="An envoy path ending in .output or .input (model.layers.1.output), or 'logits'.",
    )
    tokens: Literal["last", "all"] = Field("last", description="Token positions kept: the last prompt token, or all.")

    @field_validator("location")
    @classmethod
    def _shape(cls, value: str) -> str:
        value = value.strip()
        if value.startswith("model.logits"):
            value = value.removeprefix("model.")
        if value == "logits":
            return value
        parts = value.split(".")
        if len(parts) < 2 or parts[-1] not in ("output", "input") or not all(parts):
            raise ValueError(
                f"{value!r}: a location is a module path ending in '.output' or '.input' "
                "(e.g. 'model.layers.1.output'), or 'logits'"
            )
        return value

    @property
    def module_path(self) -> str | None:
        """The module's dotted path (``model.layers.1``), None for ``logits``."""
        return None if self.location == "logits" else self.location.rsplit(".", 1)[0]

    @property
    def attribute(self) -> str:
        return "logits" if self.location == "logits" else self.location.rsplit(".", 1)[1]


class SamplingConfig(_Section):
    """Sampling for each prompt's request; saves read the prompt's forward pass."""

    max_tokens: int = Field(1, ge=1, description="New tokens per prompt.")
    temperature: float = Field(0.0, ge=0, description="0 = greedy.")


class OutputConfig(_Section):
    """Where the rows, manifest and errors go."""

    dir: str = Field(min_length=1, description="Run folder; rerunning into it resumes.")
    shard_size: int = Field(64, ge=1, description="Prompts per block: per data file, and per activation part.")
    format: Literal["parquet", "activations"] = Field(
        "parquet",
        description="parquet: one row per prompt, values as float32 lists (any save, any intervention). "
        "activations: every prompt token's values of `saves` (module outputs, tokens: all), token-major "
        "safetensors files written by the ranks, in the model's dtype (docs/batch.md).",
    )
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        "auto", description="activations only: the stored dtype; auto keeps the dtype the model computed in."
    )
    fsync: bool = Field(
        False, description="activations only: flush each file to disk before it counts (survives a machine crash; "
        "a killed run keeps whole files either way, and resume redoes any file cut short)."
    )
    generated: bool = Field(
        False, description="activations only: every generated token's row too (sampling.max_tokens at sampling.temperature: "
        "each decode step's row at its position after the prompt; the last token is sampled, never run)."
    )


class RunnerConfig(_Section):
    """Tuning of the pipeline's engine stage; defaults suit most runs."""

    max_in_flight: int = Field(256, ge=1, description="Prompts submitted and not yet returned, per engine replica.")
    prompts_per_trace: int = Field(
        32, ge=1, description="Prompts per trace (one invoke each); a trace with a failing prompt is retried one by one."
    )
    progress_interval_s: float = Field(5.0, gt=0, description="Seconds between progress lines when stdout is not a terminal.")

    @model_validator(mode="after")
    def _window_holds_a_trace(self) -> "RunnerConfig":
        if self.prompts_per_trace > self.max_in_flight:
            raise ValueError(
                f"prompts_per_trace ({self.prompts_per_trace}) exceeds max_in_flight ({self.max_in_flight}); "
                "a trace's prompts are in flight together"
            )
        return self


class BatchConfig(_Section):
    """A whole batch run."""

    model: ModelConfig
    engine: EngineConfig = Field(default_factory=EngineConfig)
    prompts: PromptsConfig
    saves: list[SaveSpec] | None = Field(None, description="Values to save per prompt (or use `intervention`).")
    intervention: str | None = Field(
        None, description="A .py file defining `def intervene(model, tracer)` returning a dict of values to save."
    )
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    output: OutputConfig
    runner: RunnerConfig = Field(default_factory=RunnerConfig)

    @model_validator(mode="after")
    def _saves_or_intervention(self) -> "BatchConfig":
        if bool(self.saves) == bool(self.intervention):
            raise ValueError(
                "give exactly one of `saves` (a list of {location, tokens}) or `intervention` (a .py file); "
                f"got saves={'set' if self.saves else 'empty'} and intervention={self.intervention!r}"
            )
        if self.saves:
            seen: set[str] = set()
            for spec in self.saves:
                if spec.location in seen:
                    raise ValueError(f"saves: {spec.location!r} is listed twice")
                seen.add(spec.location)
        if self.intervention and Path(self.intervention).suffix != ".py":
            raise ValueError(f"intervention: {self.intervention!r} should be a .py file")
        if self.output.format == "activations":
            if self.intervention:
                raise ValueError("output.format=activations writes `saves` only; an `intervention` file needs "
                                 "output.format=parquet")
            for spec in self.saves or []:
                if spec.attribute != "output" or spec.tokens != "all":
                    raise ValueError(f"saves: {spec.location!r} (tokens: {spec.tokens}): output.format=activations "
                                     "keeps module outputs at every prompt token: give '<module>.output' with "
                                     "tokens: all, or use output.format=parquet")
            if "max_in_flight" in self.runner.model_fields_set and self.runner.max_in_flight < self.output.shard_size:
                raise ValueError(f"runner.max_in_flight ({self.runner.max_in_flight}) is below output.shard_size "
                                 f"({self.output.shard_size}): with output.format=activations a block's prompts "
                                 "are in flight together")
            if self.output.generated and self.sampling.max_tokens < 2:
                raise ValueError("output.generated keeps the rows of generated tokens, and with sampling.max_tokens "
                                 f"{self.sampling.max_tokens} none is run: raise sampling.max_tokens")
        elif self.output.dtype != "auto" or self.output.fsync or self.output.generated:
            raise ValueError("output.dtype, output.fsync and output.generated apply to output.format=activations "
                             "(parquet stores float32 and always syncs)")
        return self

    @property
    def activations(self) -> bool:
        return self.output.format == "activations"

    def max_in_flight(self) -> int:
        """Prompts in flight per engine: as configured; for activations, 8 blocks (8 parts) unless set."""
        if self.activations and "max_in_flight" not in self.runner.model_fields_set:
            return 8 * self.output.shard_size
        return self.runner.max_in_flight


# --------------------------------------------------------------------------- loading


def load_config(path: str | os.PathLike, overrides: Sequence[str] = ()) -> BatchConfig:
    """Read, override and validate a batch config; raises ``BatchConfigError``."""
    path = Path(path)
    where = f"batch config {path}"
    try:
        text = path.read_text()
    except OSError as error:
        raise BatchConfigError(f"{where}: cannot read it ({error.strerror or error})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise BatchConfigError(f"{where}: not valid YAML: {error}") from None
    if not isinstance(data, dict):
        raise BatchConfigError(f"{where}: expected a mapping of sections at the top, got {type(data).__name__}")
    data = apply_overrides(data, overrides)
    return validate(data, where)


def validate(data: dict[str, Any], where: str = "batch config") -> BatchConfig:
    """Validate a parsed config (unknown keys first, with the allowed ones named)."""
    problems = _unknown_keys(data, BatchConfig, "")
    if problems:
        raise BatchConfigError(f"{where}: " + "; ".join(problems))
    try:
        return BatchConfig.model_validate(data)
    except ValidationError as error:
        raise BatchConfigError(f"{where}: " + "; ".join(_describe(e) for e in error.errors())) from None


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """``key.sub=value`` assignments on a parsed config (a deep copy is returned)."""
    import copy

    data = copy.deepcopy(data)
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise BatchConfigError(f"override {item!r}: expected key.sub=value (e.g. engine.replicas=2)")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as error:
            raise BatchConfigError(f"override {item!r}: value is not valid YAML: {error}") from None
        parts = key.split(".")
        node: Any = data
        for depth, part in enumerate(parts[:-1]):
            node = _child(node, part, parts[: depth + 1], item, create=True)
        last = parts[-1]
        if isinstance(node, list):
            node[_index(node, last, parts, item)] = value
        elif isinstance(node, dict):
            node[last] = value
        else:
            raise BatchConfigError(f"override {item!r}: {'.'.join(parts[:-1])} is a value, not a section")
    return data


def _child(node: Any, part: str, path: list[str], item: str, create: bool) -> Any:
    if isinstance(node, list):
        return node[_index(node, part, path, item)]
    if not isinstance(node, dict):
        raise BatchConfigError(f"override {item!r}: {'.'.join(path[:-1])} is a value, not a section")
    if node.get(part) is None and create:
        node[part] = {}
    return node[part]


def _index(node: list, part: str, path: list[str], item: str) -> int:
    try:
        index = int(part)
        node[index]
    except (ValueError, IndexError):
        raise BatchConfigError(
            f"override {item!r}: {'.'.join(path)}: {'.'.join(path[:-1])} is a list of {len(node)}; "
            "index it with 0..{}".format(len(node) - 1)
        ) from None
    return index


def _section_type(annotation: Any) -> tuple[type[BaseModel] | None, bool]:
    """The pydantic model a field holds (and whether as a list), through ``X | None``."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, False
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is list and args:
        inner, _ = _section_type(args[0])
        return inner, inner is not None
    for arg in args:
        inner, is_list = _section_type(arg)
        if inner is not None:
            return inner, is_list
    return None, False


#: Keys of the hand-written runner of earlier versions, and what does their work now.
_RETIRED = {
    "runner.shard_retries": "Ray Data retries a failed batch on a live engine (an engine that died ends its actor, "
                            "which Ray Data restarts)",
    "runner.engine_restarts": "Ray Data restarts an engine stage actor whose engine died",
    "runner.request_timeout_s": "a block that runs too long is stopped by the engine's block_timeout_s "
                                "(engine.engine_kwargs)",
}


def _unknown_keys(data: Any, model: type[BaseModel], prefix: str) -> list[str]:
    if not isinstance(data, dict):
        return []
    problems = []
    allowed = list(model.model_fields)
    for key in data:
        name = f"{prefix}{key}"
        if name in _RETIRED:
            problems.append(f"'{name}' is gone with the hand-written runner: {_RETIRED[name]}; remove it")
            continue
        if key not in allowed:
            hint = difflib.get_close_matches(str(key), allowed, n=1)
            section = f"'{prefix[:-1]}'" if prefix else "the top level"
            problems.append(
                f"unknown key '{name}'"
                + (f" (did you mean '{prefix}{hint[0]}'?)" if hint else "")
                + f"; allowed in {section}: {', '.join(allowed)}"
            )
            continue
        inner, is_list = _section_type(model.model_fields[key].annotation)
        if inner is None:
            continue
        if is_list and isinstance(data[key], list):
            for i, item in enumerate(data[key]):
                problems += _unknown_keys(item, inner, f"{name}.{i}.")
        else:
            problems += _unknown_keys(data[key], inner, f"{name}.")
    return problems


def _describe(error: dict[str, Any]) -> str:
    where = ".".join(str(p) for p in error["loc"]) or "config"
    message = error["msg"].removeprefix("Value error, ")
    if error["type"] == "missing":
        return f"{where}: required key missing"
    if error["type"] in ("model_type", "dict_type"):
        return f"{where}: expected a mapping, got {error.get('input')!r}"
    shown = error.get("input")
    if isinstance(shown, (dict, list)) or error["type"].startswith("value_error"):
        return f"{where}: {message}"
    return f"{where}: {message} (got {shown!r})"
