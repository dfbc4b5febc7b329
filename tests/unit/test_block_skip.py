"""A traced block's body is skipped without ``sys.settrace`` on Python 3.12+ (``_internal.blocks.skip``).

Real nnsight (``LanguageModel`` on the project's tiny Llama, no engine): the traces through
``SkipTracer`` give nnsight's values, the body never runs inline, a frame left armed by a header
that raises is disarmed, another thread running the same code is not stopped, and nnsight's
refusals stand. On Python 3.11 (CI) the same tests run nnsight's own skip through the same classes;
the ``sys.monitoring`` path runs under a 3.12 interpreter:
``python3.12 -m pytest tests/unit/test_block_skip.py`` with nnsight, torch and pytest installed.
"""

from __future__ import annotations

import sys
import threading

import pytest
import torch

from nnsight_ray._internal.blocks import skip

monitored = pytest.mark.skipif(not hasattr(sys, "monitoring"), reason="sys.monitoring is Python 3.12+")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    import nnsight

    from nnsight_ray.models import ensure_model

    return nnsight.LanguageModel(ensure_model(str(tmp_path_factory.mktemp("tiny")), arch="llama"), dispatch=True)


PROMPTS = ["the cat sat", "on the mat today", "and then it left"]


def _trace(model, tracer_cls, ran: list):
    with model.trace(tracer_cls=tracer_cls) as tracer:
        ran.append("outer body")  # runs once, through the backend
        for prompt in PROMPTS:
            with tracer.invoke(prompt):
                ran.append("invoke body")
                h = model.model.layers[0].output[0][-1].save()
    return h


def test_values_equal_nnsights_and_each_body_runs_once_through_the_backend(model):
    from nnsight.intervention.tracer import InterleavingTracer

    expected_ran: list = []
    expected = _trace(model, InterleavingTracer, expected_ran)
    ran: list = []
    got = _trace(model, _SkipLM, ran)
    assert ran == expected_ran == ["outer body"] + ["invoke body"] * len(PROMPTS)
    assert got.shape == expected.shape and torch.equal(got, expected)  # the last invoke's value
    assert not skip._armed and sys.gettrace() is None


@monitored
def test_the_skip_does_not_touch_the_threads_tracer_and_uses_its_own_tool(model):
    ran: list = []
    before = sys.gettrace()
    _trace(model, _SkipLM, ran)
    assert sys.gettrace() is before
    assert skip._tool in skip.TOOL_IDS and sys.monitoring.get_tool(skip._tool) == skip.TOOL_NAME


@monitored
def test_a_header_that_raises_leaves_nothing_armed(model):
    with pytest.raises(KeyError):
        with model.trace(tracer_cls=_SkipLM) as tracer:
            with tracer.invoke(PROMPTS[0]):
                {}["missing"]  # the body's first line raises only if it ran inline: it does not
            raise KeyError("after the invokes")
    assert not skip._armed


@monitored
def test_another_thread_running_the_same_code_is_not_stopped():
    """A LINE event is local to a code object, not a frame: only the armed frame raises."""
    started, release, lines = threading.Event(), threading.Event(), []

    def body(arm: bool):
        if arm:
            class Probe:  # the smallest stand-in for a tracer: a node and a frame
                pass
            import ast
            probe = Probe()
            probe.node = ast.parse("with x:\n    y = 1\n").body[0]
            probe.info = type("Info", (), {"frame": sys._getframe()})()
            probe.node.lineno, probe.node.body[0].lineno = 0, sys._getframe().f_lineno + 4
            assert skip.arm(probe)
            started.set()
            release.wait(5)
            lines.append("armed frame ran on")  # this line is past the body line: it must not run
        lines.append("ran")

    other = threading.Thread(target=lambda: (started.wait(5), body(False)))
    other.start()
    with pytest.raises(Exception) as caught:
        threading.Timer(0.2, release.set).start()
        body(True)
    other.join(5)
    assert type(caught.value).__name__ == "ExitTracingException"
    assert lines == ["ran"] and not skip._armed


def test_nnsights_refusals_stand(model):
    with pytest.raises(ValueError, match="must start on its own line"):
        with model.trace(PROMPTS[0], tracer_cls=_SkipLM): h = model.model.layers[0].output.save()  # noqa: E701,F841
    with pytest.raises(ValueError, match="cannot start with `try:`"):
        with model.trace(PROMPTS[0], tracer_cls=_SkipLM):
            try:
                h = model.model.layers[0].output.save()  # noqa: F841
            finally:
                pass
    assert not skip._armed


def test_the_tracer_is_nnsights_own_where_the_skip_cannot_run_or_is_turned_off(monkeypatch):
    assert skip.tracer_cls() is (skip.SkipTracer if hasattr(sys, "monitoring") else None)
    monkeypatch.setenv(skip.ENV, "0")
    assert skip.tracer_cls() is None


def test_without_sys_monitoring_the_classes_run_nnsights_skip(model, monkeypatch):
    monkeypatch.setattr(skip, "_tool", None)
    monkeypatch.setattr(skip, "_claimed", True)
    ran: list = []
    got = _trace(model, _SkipLM, ran)
    assert ran == ["outer body"] + ["invoke body"] * len(PROMPTS) and got.dim() == 1 and not skip._armed


from nnsight.intervention.tracer import InterleavingTracer  # noqa: E402


class _SkipLM(skip._MonitoredSkip, InterleavingTracer):
    """The same skip on nnsight's base tracer: ``LanguageModel`` runs a forward, not vLLM's engine."""

    def invoke(self, *args, **kwargs):
        return skip.SkipInvoker(self, *args, **kwargs)
