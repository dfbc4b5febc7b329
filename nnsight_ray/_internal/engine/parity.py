"""Engine parity: every engine resolves the config vLLM's own entry point would.

vLLM resolves an engine's scheduler limits from its *usage context* and the
device it sees (``EngineArgs.get_batch_defaults``): ``vllm.LLM`` on an H200
gets ``max_num_seqs=1024`` and ``max_num_batched_tokens=16384``, the OpenAI
server 1024 / 8192, while a bare ``AsyncEngineArgs`` (usage context
``ENGINE_CONTEXT``, which no table names) falls to the generic 128 / 2048, so
256 prompts run as two waves. The engine actor used to build vLLM that way,
and on a process that sees no GPU (it asks Ray for none), where even the
right context falls back to the tables for "other hardware".

So an nnsight_ray engine:

* names the entry point whose defaults it takes (``usage_context``: ``LLM_CLASS``
  for offline engines, ``OPENAI_API_SERVER`` for the Serve app), and takes
  ``vllm.LLM``'s own argument defaults with it (``disable_log_stats``);
* resolves the batch-size tables on the *ranks'* platform: the engine actor
  asks a short Ray task placed in a rank's bundle (``probe_batch_defaults``)
  and hands vLLM the answer through ``EngineArgs.get_batch_defaults``, the
  method vLLM itself calls (``RankPlatformEngineArgs``);
* changes only what nnsight needs (``NNSIGHT_SETTINGS``), unless the user set it,
  and logs at start what it changed, the resolved limits, and why.

``tests/integration/test_engine_parity.py`` builds vLLM's own ``LLM``
arguments beside a running RayVLLM engine and fails on any difference in the
resolved config that ``EXPLAINED`` does not name.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import logging
from typing import Any

logger = logging.getLogger(__name__)

OFFLINE = "LLM_CLASS"  # vllm.LLM's usage context: RayVLLM, LocalVLLM, batch replicas
SERVER = "OPENAI_API_SERVER"  # vLLM's OpenAI server's: the Serve app's replicas
USAGE_CONTEXTS = (OFFLINE, SERVER)

# What nnsight needs changed from vLLM's defaults, and why (nnsight's VLLM._load sets the same).
NNSIGHT_SETTINGS: dict[str, tuple[Any, str]] = {
    "enable_chunked_prefill": (False, "a block must see a prompt whole: chunked prefill splits it across steps"),
    "enable_prefix_caching": (False, "a cached prefix runs no forward, so no hook fires for its tokens"),
    "enforce_eager": (True, "a replayed CUDA graph runs no Python, so no hook fires (graph modes: taps)"),
}

# Resolved-config fields allowed to differ from vllm.LLM given the same arguments, and why.
EXPLAINED: dict[str, str] = {
    "scheduler_config.enable_chunked_prefill": NNSIGHT_SETTINGS["enable_chunked_prefill"][1],
    "scheduler_config.chunked_prefill_enabled": NNSIGHT_SETTINGS["enable_chunked_prefill"][1],
    "scheduler_config.long_prefill_token_threshold": "follows chunked prefill (off)",
    "scheduler_config.max_num_batched_tokens": "without chunked prefill vLLM raises it to max_model_len if larger",
    "scheduler_config.max_num_partial_prefills": "follows chunked prefill (off)",
    "scheduler_config.max_long_partial_prefills": "follows chunked prefill (off)",
    "cache_config.enable_prefix_caching": NNSIGHT_SETTINGS["enable_prefix_caching"][1],
    "model_config.enforce_eager": NNSIGHT_SETTINGS["enforce_eager"][1],
    "compilation_config.mode": "follows enforce_eager (no torch.compile without graphs)",
    "compilation_config.cudagraph_mode": "follows enforce_eager",
    "compilation_config.cudagraph_capture_sizes": "follows enforce_eager",
    "compilation_config.max_cudagraph_capture_size": "follows enforce_eager",
    "compilation_config.custom_ops": "follows the compilation mode (vLLM's own kernels without torch.compile)",
    **{f"kernel_config.ir_op_priority.{op}": "follows the compilation mode (vLLM's own kernels without torch.compile)"
       for op in ("rms_norm", "fused_add_rms_norm", "gelu_and_mul_sparse")},
    "parallel_config.worker_cls": "nnsight's worker (resolved per rank's platform)",
    "parallel_config.distributed_executor_backend": "nnsight_ray's Ray rank executor",
    "parallel_config.placement_group": "the ranks' placement group, reserved before the engine starts",
    "additional_config": "the placement plan rides vLLM's config to the executor",
}
# Filled in by a started engine's KV-cache profile: outcomes, not settings (the reference never starts).
MEASURED_AT_START = ("cache_config.num_gpu_blocks", "cache_config.num_cpu_blocks", "cache_config.kv_cache_size_tokens",
                     "cache_config.kv_cache_max_concurrency", "cache_config.effective_attention_block_size")
EXPLAINED.update({key: "measured at start (KV-cache profile); the reference is not started"
                  for key in MEASURED_AT_START})


def usage_context(name: str | None) -> str:
    """Validated usage-context name (default ``LLM_CLASS``)."""
    name = name or OFFLINE
    if name not in USAGE_CONTEXTS:
        raise ValueError(f"usage_context={name!r}: one of {list(USAGE_CONTEXTS)} (vLLM's LLM class, "
                         "or its OpenAI server)")
    return name


def entrypoint_kwargs(kwargs: dict[str, Any], context: str) -> tuple[dict[str, Any], list[str]]:
    """``kwargs`` with the entry point's own argument defaults and nnsight's settings; and what changed, why.

    ``vllm.LLM`` turns stats logging off unless asked (its ``__init__``); the
    OpenAI server leaves it on. nnsight's settings never override the user's.
    """
    kwargs = dict(kwargs)
    changed = []
    if context == OFFLINE and "disable_log_stats" not in kwargs:
        kwargs["disable_log_stats"] = True  # what vllm.LLM does
    for key, (value, why) in NNSIGHT_SETTINGS.items():
        if key not in kwargs:
            kwargs[key] = value
            changed.append(f"{key}={value!r} ({why})")
    return kwargs, changed


def probe_batch_defaults(world_size: int) -> tuple[dict[str, int], dict[str, int], str]:
    """vLLM's batch-size tables as this process's platform resolves them (run where a rank runs).

    Returns ``(max_num_batched_tokens, max_num_seqs)`` by usage-context name, and
    the device they were resolved for.
    """
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform

    tokens, seqs = EngineArgs.get_batch_defaults(world_size)
    try:
        device = current_platform.get_device_name()
    except Exception:
        device = "no device visible"

    def named(table: dict) -> dict[str, int]:
        return {(key.value if isinstance(key, enum.Enum) else str(key)): value for key, value in table.items()}

    return named(tokens), named(seqs), device


@functools.cache
def rank_engine_args_class() -> type:
    """``AsyncEngineArgs`` whose batch-size tables come from the ranks' platform when given.

    ``EngineArgs._set_default_max_num_seqs_and_batched_tokens_args`` calls
    ``self.get_batch_defaults(world_size)``; this answers it with what a rank's
    process resolved (``rank_batch_defaults``), else with vLLM's own.
    """
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext

    class RankPlatformEngineArgs(AsyncEngineArgs):
        def get_batch_defaults(self, world_size: int):  # type: ignore[override]
            found = getattr(self, "rank_batch_defaults", None)
            if found is None:
                return AsyncEngineArgs.get_batch_defaults(world_size)
            tokens, seqs, _ = found
            return ({UsageContext(k): v for k, v in tokens.items()}, {UsageContext(k): v for k, v in seqs.items()})

    return RankPlatformEngineArgs


def build_engine_args(kwargs: dict[str, Any], rank_batch_defaults: tuple | None) -> Any:
    args = rank_engine_args_class()(**kwargs)
    args.rank_batch_defaults = rank_batch_defaults
    return args


def config_summary(vllm_config: Any) -> dict[str, str]:
    """The resolved config's plain fields as ``{"section.field": repr}``: what the parity test compares.

    Sections: scheduler, cache, parallel, model (plain fields only), compilation's
    mode, graph settings and custom ops, which kernel each IR op runs
    (``kernel_config.ir_op_priority``: resolved on the platform of the process that
    builds the config, so on an engine actor without a GPU it could name the CPU's
    native kernels for a GPU rank), and ``additional_config``'s keys.
    """
    summary: dict[str, str] = {}
    for section in ("scheduler_config", "cache_config", "parallel_config", "model_config"):
        config = getattr(vllm_config, section, None)
        if config is None or not dataclasses.is_dataclass(config):
            continue
        for field in dataclasses.fields(config):
            value = getattr(config, field.name, None)
            if _plain(value):
                summary[f"{section}.{field.name}"] = repr(value)
    compilation = getattr(vllm_config, "compilation_config", None)
    for name in ("mode", "cudagraph_mode", "cudagraph_capture_sizes", "max_cudagraph_capture_size", "custom_ops"):
        if compilation is not None and hasattr(compilation, name):
            summary[f"compilation_config.{name}"] = repr(getattr(compilation, name))
    priority = getattr(getattr(vllm_config, "kernel_config", None), "ir_op_priority", None)
    if priority is not None and dataclasses.is_dataclass(priority):
        for field in dataclasses.fields(priority):
            summary[f"kernel_config.ir_op_priority.{field.name}"] = repr(getattr(priority, field.name, None))
    summary["additional_config"] = repr(sorted((getattr(vllm_config, "additional_config", None) or {})))
    return summary


def _plain(value: Any) -> bool:
    if value is None or isinstance(value, (bool, int, float, str, enum.Enum)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    return False


def differences(ours: dict[str, str], theirs: dict[str, str]) -> dict[str, tuple[str | None, str | None]]:
    """Fields whose value differs (or exists on one side only)."""
    return {key: (ours.get(key), theirs.get(key)) for key in sorted(set(ours) | set(theirs))
            if ours.get(key) != theirs.get(key)}


def log_start(name: str, context: str, changed: list[str], vllm_config: Any, probed: tuple | None) -> str:
    """One log line: the entry point followed, what nnsight changed and why, the resolved limits."""
    scheduler = vllm_config.scheduler_config
    where = (f"tables of a rank's platform ({probed[2]})" if probed is not None
             else "tables of the engine actor's platform")
    line = (f"engine {name}: vLLM's {context} defaults; max_num_seqs={scheduler.max_num_seqs}, "
            f"max_num_batched_tokens={scheduler.max_num_batched_tokens} ({where}); "
            f"nnsight changed: {'; '.join(changed) or 'nothing (all set by the caller)'}")
    logger.info("%s", line)
    return line
