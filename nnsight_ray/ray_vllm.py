"""``RayVLLM``: nnsight's ``VLLM`` whose engine lives on a Ray cluster.

The client holds only nnsight's meta tree (no weights, no GPU). A trace runs
nnsight's own client code: the tracer builds the invoke workers,
``VLLM._attach_mediators`` serializes them into each request's
``SamplingParams.extra_args``, and ``VLLM._collect`` pushes the saves back into
the caller's variables. Only the transport differs: ``vllm_entrypoint`` is a
``RemoteEngine`` that sends the requests to the deployment's engine actor and
gets the merged outputs back from its merge actor as Ray object references.
So everything nnsight's in-process engine does (invokes, iter/all, edits,
logits/samples, ``tracer.result``, ``model.edit()``, ``model.generate(...)``
without a block) behaves the same here.

On top: ``trace(..., blocking=False)`` returns at once with ``tracer.ref`` (an
``ObjectRef`` resolving to ``{name: value}``) and ``tracer.collect()``, through
nnsight's backend seam (``refs.RayRefBackend``);
``RayVLLM.connect(name)`` attaches to a running named deployment from any
process of the cluster; ``mode="async"`` streams (see ``streaming.py``).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from .errors import EngineDeadError
from ._internal.cluster import ray_errors
from ._internal.cluster.placement import RAY_OPTION_NAMES
from ._internal.observe.timeline import CALLER, SENT, with_gc
from .local import LocalVLLM
from .refs import RayRefBackend, no_ref

__all__ = ["RayVLLM", "RemoteEngine"]


# Between polls of a result, a blocking caller checks that the engine actor answers.
POLL_S = 1.0
PING_TIMEOUT_S = 10.0


# The keys that make a dict one of vLLM's prompt forms (TextPrompt, TokensPrompt, ...).
_PROMPT_KEYS = ("prompt", "prompt_token_ids", "prompt_embeds", "encoder_prompt", "decoder_prompt")


def _check_request(index: int, prompt: Any, param: Any, sampling_params: type) -> None:
    """Refuse, in the caller and in words, what the engine would refuse with an empty message."""
    if isinstance(prompt, dict):
        if not any(key in prompt for key in _PROMPT_KEYS):
            raise ValueError(f"prompt {index} is a dict with keys {sorted(prompt)}; a prompt dict needs "
                             "'prompt' (text) or 'prompt_token_ids' (vLLM's TextPrompt / TokensPrompt)")
    elif not isinstance(prompt, str) and not (
            isinstance(prompt, (list, tuple)) and prompt and all(isinstance(t, int) for t in prompt)):
        shown = repr(prompt)
        raise TypeError(f"prompt {index} is {type(prompt).__name__} {shown[:80]}: give a string, a list of "
                        "token ids, or a vLLM prompt dict (TextPrompt / TokensPrompt)")
    if not isinstance(param, sampling_params):
        raise TypeError(f"sampling_params[{index}] is {type(param).__name__}, not vllm.SamplingParams: "
                        "pass SamplingParams(**settings), or the settings as keyword arguments of trace/generate")


class RemoteEngine:
    """The ``vllm_entrypoint`` of a ``RayVLLM``: vLLM's ``LLM`` surface, over Ray.

    ``generate`` takes prompts and ``SamplingParams`` and returns
    ``RequestOutput``s with ``.saves`` attached, as ``LLM.generate`` does under
    nnsight; ``collective_rpc`` reaches every rank in rank order.
    """

    def __init__(self, deployment: Any) -> None:
        self.deployment = deployment  # a deploy.Deployment
        self.engine = deployment.engine
        self.merges = deployment.merges
        self.name = deployment.name
        self.module_names: tuple[str, ...] | None = None  # the model's module paths (RayVLLM's meta tree), if known
        self._records: Any = None
        self.records()  # now, while the engine can answer: a dead one cannot say who its ranks were

    # -- waiting, and saying what died ---------------------------------------

    def records(self) -> Any:
        """Every actor of the deployment (``liveness.DeploymentRecords``), asked once of the engine."""
        if self._records is None:
            from ._internal.cluster.liveness import ENGINE, MERGE, ActorRecord, DeploymentRecords, actor_id

            try:
                self._records = ray_errors.get(self.engine.get_records.remote(), timeout=PING_TIMEOUT_S)
            except Exception:  # the engine actor is gone: what the handles say
                return DeploymentRecords(
                    ActorRecord(ENGINE, self.deployment.spec.engine_name, actor_id(self.engine)),
                    [ActorRecord(MERGE, n, actor_id(m))
                     for n, m in zip(self.deployment.spec.merge_names, self.merges)], [])
        return self._records

    def survey(self) -> list[Any]:
        """Every actor's ``liveness.ActorState`` (GCS reads)."""
        from ._internal.deploy import gcs_actor_entry
        from ._internal.cluster.liveness import read_states

        return read_states(self.records().all(), gcs_actor_entry)

    def dead(self, error: BaseException | None = None) -> EngineDeadError:
        """The deployment's death, named as its engine and merge actors name it."""
        from ._internal.deploy import alive_nodes
        from ._internal.cluster.liveness import dead_message, engine_dead

        message = dead_message(self.survey(), alive_nodes())
        return EngineDeadError(message or engine_dead(f"an actor of deployment {self.name} died ({error})"))

    def unwrap(self, error: BaseException) -> BaseException:
        """An actor call's exception as the caller should see it: the cause, or what died."""
        import ray

        if isinstance(error, ray.exceptions.RayActorError):
            return self.dead(error)
        return ray_errors.cause(error)

    def wait(self, ref: Any, timeout: float | None = None) -> Any:
        """``ray.get(ref)`` that never hangs on a dead deployment.

        Polls the result; between polls, pings the engine actor (a dead actor's
        handle fails at once), so a caller learns of a death within seconds
        even if nothing else would tell it. ``timeout`` as ``ray.get``'s.
        """
        import ray

        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            step = POLL_S if deadline is None else max(0.0, min(POLL_S, deadline - time.monotonic()))
            ready, _ = ray.wait([ref], timeout=step)
            if ready:
                try:
                    return ray.get(ref)
                except ray_errors.call_errors() as error:
                    raise self.unwrap(error) from None
            if deadline is not None and time.monotonic() >= deadline:
                raise ray.exceptions.GetTimeoutError(f"no result from deployment {self.name} in {timeout} s")
            self._ping_engine()

    def _ping_engine(self) -> None:
        import ray

        ping = self.engine.ready.remote()
        ready, _ = ray.wait([ping], timeout=PING_TIMEOUT_S)
        if ready:
            try:
                ray.get(ping)
            except ray.exceptions.RayActorError as error:
                raise self.dead(error) from None

    def _merge(self, group: str) -> Any:
        from ._internal.deploy import merge_index

        return self.merges[merge_index(group, len(self.merges))]

    @staticmethod
    def _lists(prompts: Any, sampling_params: Any, lora_request: Any) -> tuple[list, list, list | None]:
        from vllm import SamplingParams

        # vLLM's own reading (renderers.inputs.preprocess.prompt_to_seq), as LocalVLLM gets it:
        # a list of ints is one prompt of token ids, so `model.trace(5)` runs token id 5 there too.
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        elif not isinstance(prompts, (list, tuple)):
            prompts = [prompts]  # one prompt of no known kind: _check_request says what is wrong with it
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} SamplingParams; give one, or one per prompt")
        loras = list(lora_request) if isinstance(lora_request, (list, tuple)) else (
            None if lora_request is None else [lora_request] * len(prompts))
        for index, (prompt, param) in enumerate(zip(prompts, params)):
            _check_request(index, prompt, param, SamplingParams)
        return prompts, params, loras

    def submit(self, prompts: Any, sampling_params: Any = None, lora_request: Any = None) -> tuple[str, int]:
        """Start the requests on the engine; returns ``(group, size)`` for the merge actor."""
        began = time.monotonic()
        prompts, params, loras = self._lists(prompts, sampling_params, lora_request)
        group = uuid.uuid4().hex
        # Not awaited: the engine actor reports a refusal through the merge actor.
        self.engine.submit.remote(group, prompts, params, loras)
        CALLER.mark(SENT, len(prompts), began)
        return group, len(prompts)

    def generate_async(self, prompts: Any, sampling_params: Any = None, lora_request: Any = None, **_: Any) -> Any:
        """Non-blocking ``generate``: an ``ObjectRef`` to the list of ``RequestOutput``s."""
        group, size = self.submit(prompts, sampling_params, lora_request)
        return self._merge(group).outputs.remote(group, size)

    def generate(self, prompts: Any, sampling_params: Any = None, lora_request: Any = None, **kwargs: Any) -> list:
        return self.wait(self.generate_async(prompts, sampling_params, lora_request, **kwargs))

    def trace_ref(self, prompts: list, params: list, loras: list | None, presaved: set[str],
                  outputs: bool = False) -> Any:
        """Submit a trace's requests; an ``ObjectRef`` to ``{name: value}`` (raising the trace's error), or with
        ``outputs`` to ``({name: value}, [each request's summary])`` (``merge.book.request_summary``)."""
        group, size = self.submit(prompts, params, loras)
        return self._merge(group).trace.remote(group, size, set(presaved), outputs)

    def collective_rpc(self, method: str, args: tuple = (), **_: Any) -> list:
        return self.wait(self.engine.rpc.remote(method, tuple(args)))

    def stream(self, prompt: Any, param: Any, lora: Any = None) -> tuple[str, Any]:
        """Start one streamed request: ``(group, ObjectRefGenerator of RequestOutput)``."""
        group = uuid.uuid4().hex
        return group, self.engine.stream.options(num_returns="streaming").remote(group, prompt, param, lora)

    async def finished_output(self, group: str) -> Any:
        """The finished output of a streamed request, saves attached (from the merge actor)."""
        import ray

        try:
            return (await self._merge(group).outputs.remote(group, 1))[0]
        except ray_errors.call_errors() as error:
            raise self.unwrap(error) from None

    def topology(self) -> list[dict[str, Any]]:
        return self.wait(self.engine.get_topology.remote())

    # -- extraction: the ranks write every prompt token's values (``_internal.extract``) --

    def ranks(self) -> list[Any]:
        """The rank actors' handles, in rank order."""
        import ray

        from ._internal.cluster.placement import NAMESPACE

        if getattr(self, "_ranks", None) is None:
            self._ranks = [ray.get_actor(r.name, namespace=NAMESPACE) for r in self.records().ranks]
        return self._ranks

    def extract_async(self, prompts: list, part: str, directory: str, locations: list[str], *,
                      indices: list[int] | None = None, dtype: str | None = None, max_tokens: int = 1,
                      generated: bool = False, temperature: float = 0.0, ignore_eos: bool = False) -> Any:
        """Run ``prompts``; the ranks keep every prompt token's value at ``locations`` under ``part``.

        ``generated``: every generated token's row too (``max_tokens``, sampled at ``temperature``,
        greedy by default; each decode step's row, at its position after the prompt: a sequence of ``p``
        prompt tokens and ``n`` generated ones has ``p + n - 1`` rows, the last token being sampled,
        never run). Returns the
        ``ObjectRef`` of the plain outputs (no saves travel). Prompt ``i`` is recorded as
        ``indices[i]`` (default ``i``). Nothing is written until ``extract_commit``.
        """
        from vllm import SamplingParams

        from ._internal.extract.capture import check_locations, request_args

        check_locations(locations, self.module_names)
        indices = list(range(len(prompts))) if indices is None else list(indices)
        params = [SamplingParams(max_tokens=max_tokens, temperature=temperature, detokenize=False, ignore_eos=ignore_eos,
                                 extra_args=request_args(part, index, directory, locations, dtype, generated))
                  for index in indices]
        return self.generate_async(list(prompts), params)

    def extract_commit(self, part: str, timeout: float = 600.0, fsync: bool = False) -> list[Any]:
        """One ``ObjectRef`` per rank: the file each writing rank wrote for ``part`` (None elsewhere).

        ``fsync``: see ``_internal.extract.commit``.
        """
        return [rank.extract_commit.remote(part, timeout, fsync) for rank in self.ranks()]

    def extract_discard(self, part: str) -> None:
        for rank in self.ranks():
            rank.extract_discard.remote(part)

    def resolved_config(self) -> dict[str, Any]:
        return self.wait(self.engine.resolved_config.remote())

    def timeline(self, since: float = 0.0) -> dict[str, list]:
        got = self.wait(self.engine.timeline.remote(since))
        return {**got, "caller": with_gc(CALLER.since(since), since)}

    def health(self) -> dict[str, Any]:
        """The engine actor's health; if it cannot answer, what the GCS says of every actor."""
        import ray

        from ._internal.cluster.liveness import as_dicts

        try:
            return self.wait(self.engine.health.remote(), timeout=3 * PING_TIMEOUT_S)
        except (EngineDeadError, ray.exceptions.GetTimeoutError) as error:
            return {"alive": False, "error": str(error), "actors": as_dicts(self.survey())}


class RayVLLM(LocalVLLM):
    """nnsight's ``VLLM`` with its engine deployed on (or attached from) a Ray cluster.

    Args:
        model: Checkpoint path or id, readable by every node.
        name: Deployment name (actors ``<name>.engine``, ``<name>.merge<i>``,
            ``<name>.pp<p>.tp<t>`` in namespace ``nnsight_ray``). Defaults to a
            fresh unique one.
        tensor_parallel_size, pipeline_parallel_size: the layout.
        placement_strategy, cpus_per_rank, gpus_per_rank, placement_timeout_s,
            placement_group, cpu_binding: see ``RankPlacement``.
        num_merge_actors: merge shards (requests are spread by id).
        engine_actor_options: extra Ray ``.options()`` for the engine actor (e.g. a
            custom resource that keeps it on a GPU node; see docs/clusters.md).
        usage_context: whose defaults vLLM resolves the engine's limits with:
            ``"LLM_CLASS"`` (``vllm.LLM``'s, the default) or ``"OPENAI_API_SERVER"``
            (vLLM's OpenAI server's; the Serve app's engines), on the ranks' device.
        detached: keep the deployment after this process exits, until
            ``shutdown()`` (from any process, after ``connect``).
        mode: ``"sync"`` or ``"async"`` (streaming traces).
        **engine_kwargs: vLLM engine arguments (``max_model_len``, ``dtype``, ...).

    Examples::

        model = RayVLLM(path, tensor_parallel_size=2, placement_strategy="STRICT_SPREAD", name="llama")
        with model.trace("Hello", temperature=0.0):
            h = model.model.layers[1].output[0].save()
        with model.trace("Hello", blocking=False) as tracer:
            logits = model.logits.save()
        tracer.ref          # ray.ObjectRef -> {"logits": tensor}
        other = RayVLLM.connect("llama")   # from any process in the cluster
        model.shutdown()
    """

    def __init__(self, model: str, *, name: str | None = None, num_merge_actors: int = 1,
                 detached: bool = False, tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
                 engine_actor_options: dict[str, Any] | None = None, usage_context: str = "LLM_CLASS",
                 _deployment: Any = None, **kwargs: Any) -> None:
        from ._internal import deploy

        nnsight_kwargs = {k: kwargs.pop(k) for k in ("mode", "envoys") if k in kwargs}
        if _deployment is None:
            # The engine starts while this process builds the meta model.
            _deployment = self._launch(model, name=name, num_merge_actors=num_merge_actors, detached=detached,
                                    tensor_parallel_size=tensor_parallel_size,
                                    pipeline_parallel_size=pipeline_parallel_size,
                                    engine_actor_options=engine_actor_options, usage_context=usage_context,
                                    **kwargs)
        # The deploy.Deployment (None once shut down, and in a pickled copy) and its name.
        self._deployment, self._deployment_name = _deployment, _deployment.name
        engine_kwargs = {k: v for k, v in kwargs.items() if k not in RAY_OPTION_NAMES}
        try:
            super().__init__(model, **nnsight_kwargs, **engine_kwargs)
            if self.taps:  # the operations sourced taps name, on the meta tree (a miss takes the launch down)
                from ._internal.blocks.graphs import open_sourced

                open_sourced(self, self._resolve_taps(self._module))
            # Edits installed by other clients of a shared deployment are unseen
            # here; the worker checks every request's edit names itself.
            self._serving = True
            self.dispatch()
        except BaseException:
            if _deployment.starting is not None:  # launched here, failed before serving: take it down
                deploy.discard(_deployment)
            raise

    @staticmethod
    def _launch(model: str, *, name: str | None = None, num_merge_actors: int = 1, detached: bool = False,
                tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
                engine_actor_options: dict[str, Any] | None = None, usage_context: str = "LLM_CLASS",
                **kwargs: Any) -> Any:
        """Start a deployment of ``model`` (``RayVLLM`` arguments) without waiting for it."""
        from ._internal import deploy
        from ._internal.cluster.placement import RankPlacement, connect_ray

        connect_ray()
        placement = RankPlacement.from_options({k: kwargs.pop(k) for k in list(kwargs) if k in RAY_OPTION_NAMES})
        for key in ("mode", "envoys"):
            kwargs.pop(key, None)
        engine_kwargs = {**kwargs, "tensor_parallel_size": tensor_parallel_size,
                         "pipeline_parallel_size": pipeline_parallel_size}
        return deploy.launch(name or f"nnsight-{uuid.uuid4().hex[:8]}", model, engine_kwargs,
                             placement, num_merge_actors=num_merge_actors,
                             detached=detached, engine_actor_options=engine_actor_options,
                             usage_context=usage_context)

    @classmethod
    def start_many(cls, model: str, layouts: dict[str, dict[str, Any]], **common: Any) -> dict[str, "RayVLLM"]:
        """Start several deployments of ``model`` at once; ``{name: RayVLLM}``.

        ``layouts`` maps each deployment name to its own ``RayVLLM`` arguments
        (``tensor_parallel_size``, ``placement_strategy``, ...); ``common``
        applies to all. The engines come up concurrently (a start is mostly
        processes importing vLLM and waiting on each other, so two overlap to
        well under twice one); if one fails, the others are shut down and its
        error is raised.

        Example::

            engines = RayVLLM.start_many(path, {"tp2": {"tensor_parallel_size": 2},
                                                "pp2": {"pipeline_parallel_size": 2}}, dtype="float32")
        """
        from ._internal import deploy

        launched: dict[str, Any] = {}
        models: dict[str, RayVLLM] = {}
        try:
            for name, layout in layouts.items():
                launched[name] = cls._launch(model, name=name, **{**common, **layout})
            for name, layout in layouts.items():
                models[name] = cls(model, name=name, _deployment=launched[name], **{**common, **layout})
        except BaseException:
            for name, deployment in launched.items():
                if name in models:
                    models[name].shutdown()
                else:
                    deploy.discard(deployment)
            raise
        return models

    @classmethod
    def connect(cls, name: str, **nnsight_kwargs: Any) -> "RayVLLM":
        """Attach to the running deployment ``name`` from any process in the cluster."""
        from ._internal import deploy
        from ._internal.cluster.placement import connect_ray

        connect_ray()
        deployment = deploy.connect(name)
        spec = deployment.spec
        kwargs = {k: v for k, v in spec.engine_kwargs.items()
                  if k not in ("tensor_parallel_size", "pipeline_parallel_size")}
        return cls(spec.model, name=name, _deployment=deployment, **nnsight_kwargs, **kwargs)

    def _load(self, repo_id: str, **kwargs: Any) -> Any:
        from ._internal import deploy

        meta_model = self.__dict__.get("_module")
        if meta_model is None:
            meta_model = self._load_meta(repo_id, **kwargs)
        # As VLLM._load: the single-rank group brought up for the meta build is
        # not needed once the tree exists.
        if self._owns_distributed:
            self._cleanup_distributed()
            self._owns_distributed = False
        if self.taps:
            self._resolve_taps(meta_model)  # a pattern naming no module fails here; the ranks resolve their own
        self.vllm_entrypoint = RemoteEngine(deploy.wait_started(self._deployment))
        self.vllm_entrypoint.module_names = tuple(name for name, _ in meta_model.named_modules())
        return meta_model

    @property
    def name(self) -> str:
        return self._deployment_name

    @property
    def model_path(self) -> str | None:
        """The checkpoint folder or hub id the deployment serves (as it was started); None once pickled."""
        return self._deployment.spec.model if self._deployment is not None else None

    def _pipeline_stages(self) -> int:
        if self._deployment is None:
            return 1
        return int(self._deployment.spec.engine_kwargs.get("pipeline_parallel_size") or 1)

    def trace(self, *inputs: Any, blocking: bool = True, outputs: bool = False, **kwargs: Any) -> Any:
        """nnsight's trace; ``blocking=False`` returns at once with ``tracer.ref`` (see ``refs``).

        ``outputs=True`` (with ``blocking=False``): ``tracer.collect()`` returns ``(values, outputs)``, each
        invoke's prompt token ids, generated token ids and text in invoke order, read from the finished requests:
        no block has to wait on ``tracer.result`` for them, which holds the request's intervention open to its end.
        """
        own_backend = kwargs.get("backend") is None and kwargs.get("serve") is None
        if outputs and (blocking or not own_backend or self._async_engine):
            raise ValueError("trace(outputs=True) needs blocking=False on a RayVLLM's own backend (not async, "
                             "not serve=, not a backend of your own); read tracer.result in the block instead")
        if own_backend and self._async_engine:
            from .streaming import RayStreamBackend

            kwargs["backend"] = RayStreamBackend(self)
        elif own_backend and not blocking:
            kwargs["backend"] = RayRefBackend(self, outputs=outputs)
        tracer = super().trace(*inputs, **kwargs)
        if not isinstance(kwargs.get("backend"), RayRefBackend):
            no_ref(tracer)
        return tracer

    def __getstate__(self) -> dict:
        # A block that references the model may pickle it (by value on a
        # pipeline stage, see `_internal.envoy_refs`); live actor handles stay home.
        state = super().__getstate__()
        state["_deployment"] = None
        return state

    def topology(self) -> list[dict[str, Any]]:
        """Each rank's pp rank, tp rank, node id and actor name, in rank order."""
        return self.vllm_entrypoint.topology()

    def health(self) -> dict[str, Any]:
        return self.vllm_entrypoint.health()

    def resolved_config(self) -> dict[str, Any]:
        """The engine's resolved vLLM config, ``{"config": {"section.field": repr}, "log": start line}``.

        What nnsight changed from vLLM's own entry point's resolution, and why,
        is the log line (``_internal/engine/parity.py``).
        """
        return self.vllm_entrypoint.resolved_config()

    def timeline(self, since: float = 0.0) -> dict[str, list]:
        """What the engine did from ``since`` (``time.monotonic()`` on the engine's host) on: the engine
        actor's submits, adds and request ends, each rank's steps (start, tokens, end), the merge actors'
        fetches and hand-backs, and this process's attaches and sends (``caller``); a diagnostic
        (``_internal/observe/timeline.py``; ``python -m benchmarks.gpu`` prints one line per workload)."""
        return self.vllm_entrypoint.timeline(since)

    def request_counts(self) -> list[int]:
        """``nnsight_request_count`` on every rank (0 when no request holds workers)."""
        return self.vllm_entrypoint.collective_rpc("nnsight_request_count")

    def shutdown(self) -> None:
        """Release every actor and placement group of this deployment."""
        from ._internal import deploy

        if self._deployment is not None:
            deploy.shutdown(self._deployment)
            self._deployment = None
        self.vllm_entrypoint = None
