"""``intervention_error``: a failed intervention keeps its builtin type at the caller.

Pure logic (no engine, no Ray); the engine path is in
tests/integration/test_local_engine.py.
"""

from __future__ import annotations

import pytest

from nnsight_ray.errors import NNsightRayError, RequestError


@pytest.fixture(scope="module")
def intervention_error():
    from nnsight_ray.local import intervention_error

    return intervention_error


def deferred(name: str, message: str = "boom") -> tuple[dict, str]:
    error = {"type_name": name, "message": message, "traceback": "  File x\n", "is_control_flow": False}
    return error, f"{name}: {message}\n\nIntervention traceback:\n  File x"


@pytest.mark.parametrize(
    "name, builtin",
    [
        ("ValueError", ValueError),
        ("IndexError", IndexError),
        ("KeyError", KeyError),
        ("TypeError", TypeError),
        ("AttributeError", AttributeError),
        ("ZeroDivisionError", ZeroDivisionError),
        ("NotImplementedError", NotImplementedError),
        ("OSError", OSError),
    ],
)
def test_builtin_types_are_kept(intervention_error, name, builtin):
    error, message = deferred(name)
    exc = intervention_error(error, message)
    assert isinstance(exc, builtin)
    # nnsight's own contract still holds: a RuntimeError whose text starts with the type.
    assert isinstance(exc, RuntimeError) and isinstance(exc, RequestError)
    assert str(exc) == message  # KeyError's repr-quoting does not apply
    assert type(exc).__name__ == name
    assert type(intervention_error(*deferred(name))) is type(exc)  # one class per type
    with pytest.raises(builtin, match=f"^{name}: boom"):
        raise exc


@pytest.mark.parametrize(
    "name", ["OutOfOrderError", "MyCustomError", "RuntimeError", "Exception", "StopIteration", "KeyboardInterrupt", "print"]
)
def test_other_types_become_request_errors(intervention_error, name):
    error, message = deferred(name)
    exc = intervention_error(error, message)
    assert type(exc) is RequestError
    assert isinstance(exc, NNsightRayError) and exc.recoverable
    assert str(exc) == message


def test_missing_type_name(intervention_error):
    assert type(intervention_error({}, "?")) is RequestError


@pytest.mark.parametrize("name", ["ValueError", "KeyError", "MyCustomError"])
def test_errors_keep_their_deferred_form_and_cross_processes(intervention_error, name):
    """Raised in a merge actor, caught in the caller: pickle (and Ray's cloudpickle) keep type, text, deferred."""
    import pickle

    import cloudpickle

    error, message = deferred(name)
    exc = intervention_error(error, message)
    assert exc.deferred == error
    for codec in (pickle, cloudpickle):
        back = codec.loads(codec.dumps(exc))
        assert type(back) is type(exc) and str(back) == str(exc) and back.deferred == error
