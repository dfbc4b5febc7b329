"""Engine parity (issue 22, item 2): a RayVLLM engine resolves the config ``vllm.LLM`` resolves.

The reference is vLLM's own ``LLM.__init__`` with the same arguments on the
same platform (the CPU build here): everything it does up to building the
engine runs for real, and the engine arguments it hands ``LLMEngine`` are
resolved with the usage context it names. Any field of the resolved
scheduler, cache, parallel, model or compilation config that differs from a
running RayVLLM engine's must be one ``parity.EXPLAINED`` names, with its
reason; with nnsight's settings given to ``LLM`` too, only the executor's own
fields may differ.
"""

from __future__ import annotations

import pytest
from conftest import ENGINE_KWARGS

from nnsight_ray._internal.engine import parity

# Fields that differ only because the ranks are nnsight_ray's Ray actors.
EXECUTOR_ONLY = {"parallel_config.worker_cls", "parallel_config.distributed_executor_backend",
                 "parallel_config.placement_group", "additional_config"}


class _Captured(Exception):
    pass


def llm_resolves(monkeypatch, model_dir: str, **kwargs) -> dict[str, str]:
    """``parity.config_summary`` of the config ``vllm.LLM(model_dir, **kwargs)`` would run with."""
    import vllm.entrypoints.llm as llm_module

    seen = {}

    def capture(engine_args, usage_context=None, **_):
        seen.update(args=engine_args, context=usage_context)
        raise _Captured

    with monkeypatch.context() as patch:
        patch.setattr(llm_module.LLMEngine, "from_engine_args", staticmethod(capture))
        with pytest.raises(_Captured):
            llm_module.LLM(model_dir, **kwargs)
    assert seen["context"].value == parity.OFFLINE
    return parity.config_summary(seen["args"].create_engine_config(seen["context"]))


@pytest.mark.parametrize("layout", ["tp1", "tp2"])
def test_rayvllm_resolves_what_vllm_llm_resolves(request, monkeypatch, model_dir, layout):
    model = request.getfixturevalue(f"ray_{layout}")
    resolved = model.resolved_config()
    ours = resolved["config"]
    kwargs = dict(ENGINE_KWARGS, tensor_parallel_size=2 if layout == "tp2" else 1)

    plain = parity.differences(ours, llm_resolves(monkeypatch, model_dir, **kwargs))
    unexplained = {k: v for k, v in plain.items() if k not in parity.EXPLAINED}
    assert not unexplained, f"RayVLLM vs vllm.LLM, same arguments: unexplained differences {unexplained}"
    assert "scheduler_config.max_num_seqs" not in plain  # the usage context's table, not the generic 128

    settings = {key: value for key, (value, _) in parity.NNSIGHT_SETTINGS.items() if key != "enforce_eager"}
    # The session's tp2 is a graph engine (taps): vLLM given the same asks the same, breakable graphs included.
    graphs = layout == "tp2"
    with monkeypatch.context() as patch:
        if graphs:
            patch.setenv("VLLM_USE_BREAKABLE_CUDAGRAPH", "1")
        reference = llm_resolves(monkeypatch, model_dir, enforce_eager=not graphs, **settings, **kwargs)
    same = parity.differences(ours, reference)
    assert set(same) <= EXECUTOR_ONLY | set(parity.MEASURED_AT_START), f"with nnsight's settings too, only the executor may differ: {same}"

    log = resolved["log"]
    assert "LLM_CLASS defaults" in log and "enable_chunked_prefill=False" in log, log
    assert f"max_num_seqs={ours['scheduler_config.max_num_seqs']}" in log
