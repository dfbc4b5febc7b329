"""Saved values are snapshots (``_internal/blocks/snapshot.py``), on nnsight's real interleaver.

The toy model writes its inputs in place the way vLLM's CUDA
``fused_add_rms_norm`` does, so a saved output is overwritten by the next
layer unless the model goes on with a copy.
"""

from __future__ import annotations

import nnsight
import pytest
import torch

from nnsight_ray._internal.blocks import snapshot
from nnsight_ray._internal.blocks.snapshot import SnapshotInterleaver


class FusedAddInPlace(torch.nn.Module):
    """``residual += hidden; hidden = 2 * residual``, written into the inputs."""

    def forward(self, hidden, residual):
        residual.add_(hidden)
        hidden.copy_(residual * 2)
        return hidden, residual


class Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = FusedAddInPlace()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, hidden, residual):
        hidden, residual = self.norm(hidden, residual)
        return self.lin(hidden), residual


class Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([Layer() for _ in range(3)])

    def forward(self, x):
        hidden, residual = x, torch.zeros_like(x)
        for layer in self.layers:
            hidden, residual = layer(hidden, residual)
        return hidden


def _reference(net, x, upto):
    """Each layer's output, copied as it is produced (what transformers would give)."""
    hidden, residual = x.clone(), torch.zeros_like(x)
    outs = []
    with torch.no_grad():
        for layer in net.layers[: upto + 1]:
            hidden, residual = layer(hidden, residual)
            outs.append((hidden.clone(), residual.clone()))
    return outs


@pytest.fixture
def net():
    torch.manual_seed(0)
    return Toy()


def _model(net, snap: bool):
    model = nnsight.NNsight(net)
    if snap:
        SnapshotInterleaver.install(model.interleaver)
    return model


def test_without_snapshot_a_saved_output_is_overwritten(net):
    """The bug the module fixes, reproduced: the next layer's in-place kernel rewrites the save."""
    x = torch.randn(2, 4)
    model = _model(net, snap=False)
    with model.trace(x.clone()):
        saved = model.layers[0].output.save()
    ref = _reference(net, x, 0)[0]
    assert not torch.allclose(saved[1], ref[1])


def test_saved_outputs_and_views_are_what_the_layer_produced(net):
    x = torch.randn(2, 4)
    ref = _reference(net, x, 2)
    model = _model(net, snap=True)
    with model.trace(x.clone()):
        first = model.layers[0].output.save()
        row = model.layers[0].output[1][-1].save()  # a view into the residual
        second = model.layers[1].output.save()
        third = model.layers[2].output.save()
        out = model.output.save()
    whole = [first, second, third]
    for i in range(3):
        torch.testing.assert_close(whole[i][0], ref[i][0])
        torch.testing.assert_close(whole[i][1], ref[i][1])
    torch.testing.assert_close(row, ref[0][1][-1])
    torch.testing.assert_close(out, net(x.clone()))  # the model's own result is unchanged


def test_saved_inputs_are_what_the_module_was_given(net):
    x = torch.randn(2, 4)
    ref = _reference(net, x, 1)
    model = _model(net, snap=True)
    with model.trace(x.clone()):
        given = model.layers[1].norm.input.save()  # hidden, before norm writes it
    torch.testing.assert_close(given, ref[0][0])


def test_edits_while_the_block_holds_the_location_reach_the_model(net):
    x = torch.randn(2, 4)
    for snap in (False, True):
        model = _model(net, snap)
        with model.trace(x.clone()):
            model.layers[0].output[0][:] = 0  # in place
            out_inplace = model.output.save()
        model = _model(net, snap)
        with model.trace(x.clone()):
            model.layers[0].output = (torch.zeros(2, 4), model.layers[0].output[1])  # swap
            out_swap = model.output.save()
        if not snap:
            expected = (out_inplace, out_swap)
    torch.testing.assert_close(out_inplace, expected[0])
    torch.testing.assert_close(out_swap, expected[1])
    torch.testing.assert_close(out_inplace, out_swap)


def test_cache_holds_snapshots(net):
    x = torch.randn(2, 4)
    ref = _reference(net, x, 2)
    model = _model(net, snap=True)
    with model.trace(x.clone()) as tracer:
        cache = tracer.cache(modules=[model.layers[0]])
    entry = cache["model.layers.0"].output
    torch.testing.assert_close(entry[1], ref[0][1])


def test_only_served_locations_are_copied(net, monkeypatch):
    copies = []
    original = snapshot._copy
    monkeypatch.setattr(snapshot, "_copy", lambda value: copies.append(1) or original(value))
    model = _model(net, snap=True)
    with model.trace(torch.randn(2, 4)):
        model.layers[2].output.save()
    assert len(copies) == 1


def test_install_is_idempotent_and_stacks_under_other_swaps(net):
    model = nnsight.NNsight(net)
    SnapshotInterleaver.install(model.interleaver)
    first = type(model.interleaver)
    SnapshotInterleaver.install(model.interleaver)
    assert type(model.interleaver) is first
    assert isinstance(model.interleaver, SnapshotInterleaver)


def test_switch(monkeypatch):
    monkeypatch.delenv(snapshot.ENV, raising=False)
    assert snapshot.enabled()
    for off in ("0", "false", "off"):
        monkeypatch.setenv(snapshot.ENV, off)
        assert not snapshot.enabled()
