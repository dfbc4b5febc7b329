"""``build_app``'s arguments, validated where they enter.

They arrive from three places with three shapes: a Python dict
(``build_app({...})``), a Serve config's ``args:`` mapping (YAML types), and
``serve run nnsight_ray.serve:build_app key=value ...``, where every value is a
string. Pydantic's lax mode turns ``"2"`` into ``2``; ``engine_kwargs`` may also
be a JSON object in a string, the only way to spell a mapping on that command
line. Unknown keys are refused with the list of known ones, so a typo fails at
deploy time instead of silently building the wrong engine.
"""

from __future__ import annotations

import json
import os
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator, model_validator

from .._internal.cluster.placement import PlacementStrategy, RankPlacement
from .jobs import JobLimits
from .security import DEFAULT_TENANT
from .tenants import DEFAULT_RUNAWAY_PENALTY

__all__ = ["API_KEY_ENV", "DEFAULT_MAX_BODY_BYTES", "ServeArgs", "ServeArgsError"]

API_KEY_ENV = "NNSIGHT_RAY_API_KEY"
DEFAULT_MAX_BODY_BYTES = 64 << 20

# Set through build_app's own arguments, never through engine_kwargs.
_LAYOUT_KEYS = ("tensor_parallel_size", "pipeline_parallel_size", "placement_strategy")


def _mapping(name: str, value: Any, example: str) -> Any:
    """A mapping argument as given: None is empty, a string must be a JSON object (the command line's spelling)."""
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError as error:
            raise ValueError(f"{name} is a string but not JSON ({error}); write e.g. {name}='{example}'") from None
    return value


class ServeArgsError(ValueError):
    """``build_app`` was given arguments it cannot deploy; nothing was started."""


class ServeArgs(BaseModel):
    """What one nnsight Serve application deploys, per replica."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(..., min_length=1, description="Checkpoint path or id, readable on every node.")
    tensor_parallel_size: int = Field(1, ge=1, description="Ranks splitting each layer, per replica.")
    pipeline_parallel_size: int = Field(1, ge=1, description="Ranks splitting the layer stack, per replica.")
    placement_strategy: PlacementStrategy = RankPlacement.model_fields["placement_strategy"]
    api_key: SecretStr | None = Field(
        None,
        description=f"Required on every route but /health (header ndif-api-key, or Authorization: Bearer). "
        f"Defaults to ${API_KEY_ENV} in the builder's, then the replica's, environment.",
    )
    api_keys: dict[str, SecretStr] = Field(
        default_factory=dict,
        description="One key per tenant, {name: key} (a JSON object on the command line): the key's name is the "
        "tenant, what runaway_penalty counts by. Beside api_key (the tenant 'default'), or instead of it.")
    runaway_penalty: float = Field(
        DEFAULT_RUNAWAY_PENALTY, ge=0, description="After a tenant's block is stopped at its deadline, its new "
        "traces on that replica are refused (429) for this many times the time the block held the engine; 0 off. "
        "Applies only when tenants have keys of their own (api_keys).")
    stalled_after_s: float = Field(
        2.0, gt=0, description="Serve routes new requests past a replica whose engine has gone this long without "
        "finishing a step while it has work (a block holding the model), while another replica is free.")
    max_body_bytes: int = Field(
        DEFAULT_MAX_BODY_BYTES, gt=0, description="Largest request body accepted (413 above it)."
    )
    num_replicas: int = Field(
        1, ge=1, description="Independent engines behind the route (a Serve config's deployments entry overrides it)."
    )
    engine_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="vLLM engine arguments (max_model_len, dtype, ...), passed as they are."
    )
    engine: str | None = Field(
        None, description="Serve the running RayVLLM deployment of this name (RayVLLM(..., name=...)) instead of "
        "starting one per replica; every replica attaches to it and none shuts it down. Layout arguments and "
        "engine_kwargs are then the deployment's own and must be left unset.")
    served_names: list[str] = Field(
        default_factory=list, description="Names a remote=True model key may carry besides `model` (and `engine`): "
        "the hub id clients build VLLM(...) with, a short name. A comma-separated string on the command line.")
    public_url: str | None = Field(
        None, description="Base URL clients reach this application at, for result download URLs "
        "(default: the URL each request arrived at).")
    job_timeout_s: float = JobLimits.model_fields["job_timeout_s"]
    result_ttl_s: float = JobLimits.model_fields["result_ttl_s"]
    max_result_bytes: int = JobLimits.model_fields["max_result_bytes"]
    max_stored_bytes: int = JobLimits.model_fields["max_stored_bytes"]
    inline_result_bytes: int = JobLimits.model_fields["inline_result_bytes"]

    @field_validator("served_names", mode="before")
    @classmethod
    def _served_names(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [name.strip() for name in value.split(",") if name.strip()]
        return value

    @model_validator(mode="after")
    def _attached(self) -> "ServeArgs":
        if self.engine is not None and (self.world_size > 1 or self.engine_kwargs):
            raise ValueError("engine= serves a running deployment with its own layout and engine arguments; "
                             "leave tensor_parallel_size, pipeline_parallel_size and engine_kwargs unset")
        return self

    @field_validator("api_keys", mode="before")
    @classmethod
    def _api_keys(cls, value: Any) -> Any:
        value = _mapping("api_keys", value, '{"alice": "<key>", "bob": "<key>"}')
        if isinstance(value, dict):
            if any(not str(name).strip() for name in value):
                raise ValueError("api_keys: every tenant needs a name")
            if any(not (v.get_secret_value() if isinstance(v, SecretStr) else v) for v in value.values()):
                raise ValueError("api_keys: every tenant needs a non-empty key")
        return value

    @field_validator("engine_kwargs", mode="before")
    @classmethod
    def _engine_kwargs(cls, value: Any) -> Any:
        value = _mapping("engine_kwargs", value, '{"max_model_len": 256}')
        if isinstance(value, dict):
            clash = sorted(k for k in value if k in _LAYOUT_KEYS)
            if clash:
                raise ValueError(f"engine_kwargs sets {clash}; give them as build_app arguments instead")
            from ..errors import RequestError
            from .._internal.blocks.graphs import engine_mode

            from .._internal.ranks.limits import engine_limits

            try:
                engine_mode(value)  # enforce_eager / taps (CUDA graphs): a contradiction is refused here
                engine_limits(value)  # the tenant limits (block_timeout_s, max_save_bytes, ...)
            except (RequestError, ValueError) as error:
                raise ValueError(f"engine_kwargs: {error}") from None
        return value

    @property
    def world_size(self) -> int:
        """Ranks (placement-group bundles) per replica."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def resolved_api_key(self, environ: dict[str, str] | None = None) -> str | None:
        """The key to require: the argument, else ``$NNSIGHT_RAY_API_KEY``, else None (open)."""
        if self.api_key is not None and self.api_key.get_secret_value():
            return self.api_key.get_secret_value()
        environ = os.environ if environ is None else environ
        return environ.get(API_KEY_ENV) or None

    def resolved_keys(self, environ: dict[str, str] | None = None) -> dict[str, str] | None:
        """``{tenant: key}`` to require: ``api_keys``, plus ``resolved_api_key`` as tenant ``"default"``; None: open.

        Raises ``ServeArgsError`` when two tenants share a key (a request could not say whose it is)."""
        keys = {name: key.get_secret_value() for name, key in self.api_keys.items()}
        single = self.resolved_api_key(environ)
        if single is not None:
            if DEFAULT_TENANT in keys and keys[DEFAULT_TENANT] != single:
                raise ServeArgsError(f"api_keys names a tenant {DEFAULT_TENANT!r}, the name api_key's key has")
            keys.setdefault(DEFAULT_TENANT, single)
        if len(set(keys.values())) < len(keys):
            raise ServeArgsError("api_keys: two tenants have the same key; give each its own")
        return keys or None

    def penalty(self, keys: dict[str, str] | None) -> float:
        """The runaway penalty in force: ``runaway_penalty`` when ``keys`` tell tenants apart (two or more), else 0."""
        return self.runaway_penalty if keys is not None and len(keys) > 1 else 0.0

    def job_limits(self) -> JobLimits:
        """The bounds of the application's job book (``remote=True``)."""
        return JobLimits(**{name: getattr(self, name) for name in JobLimits.model_fields})

    def model_names(self) -> list[str]:
        """Every checkpoint name a ``remote=True`` model key may carry for this application."""
        return [self.model, *self.served_names, *([self.engine] if self.engine else [])]

    def engine_options(self) -> dict[str, Any]:
        """Keyword arguments of ``RayVLLM`` besides the model path and name."""
        return {
            "tensor_parallel_size": self.tensor_parallel_size,
            "pipeline_parallel_size": self.pipeline_parallel_size,
            "placement_strategy": self.placement_strategy,
            # vLLM's OpenAI server's defaults (batch limits, stats logging), as `vllm serve` resolves them.
            "usage_context": "OPENAI_API_SERVER",
            **self.engine_kwargs,
        }

    @classmethod
    def parse(cls, args: dict[str, Any] | None) -> "ServeArgs":
        """Validate ``args``; raise :class:`ServeArgsError` naming every problem and the known keys."""
        args = dict(args or {})
        try:
            return cls.model_validate(args)
        except ValidationError as error:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or '(args)'}: {e['msg']}" for e in error.errors()
            )
            raise ServeArgsError(
                f"invalid nnsight_ray.serve:build_app arguments: {problems}. "
                f"Known arguments: {sorted(cls.model_fields)}."
            ) from None
