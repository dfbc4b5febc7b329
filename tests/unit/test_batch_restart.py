"""The batch runner restarts an engine replica that failed with the run's model and engine settings.

Pure logic: ``start_replicas`` (which would start a RayVLLM) is replaced by a recorder; the replica is a
plain object. The restart path once passed the prepared run as the model path and the run's tag as the
engine config, so every restart failed and the replica was retired instead.
"""

from __future__ import annotations

from types import SimpleNamespace

from nnsight_ray.batch import runner as runner_module
from nnsight_ray.batch.config import validate
from nnsight_ray.batch.replicas import Replica
from nnsight_ray.batch.runner import BatchRunner


class Engine:
    def topology(self):
        return []

    def shutdown(self):
        self.down = True


def test_a_failed_replica_is_restarted_with_the_runs_model_and_engine(monkeypatch):
    config = validate({"model": {"path": "/models/m"}, "prompts": {"path": "p.jsonl"},
                       "saves": [{"location": "logits"}], "output": {"dir": "out"},
                       "engine": {"tensor_parallel_size": 2}, "runner": {"engine_restarts": 1}})
    calls = []

    def start(indices, model_path, engine, tag, generation=0):
        calls.append((list(indices), model_path, engine, tag, generation))
        fresh = Replica(indices[0], Engine(), owned=True)
        fresh.generation = generation
        return [fresh]

    monkeypatch.setattr(runner_module, "start_replicas", start)
    runner = object.__new__(BatchRunner)
    runner.prepared = SimpleNamespace(model_path="/resolved/m", config=config)
    runner.config, runner.tag, runner.failed = config, "abc123", {}
    old = Replica(0, Engine(), owned=True)
    old.served = 7
    runner.replicas = [old]
    scheduler = SimpleNamespace(lost=lambda chunk, failure: None, failed={})

    runner._replica_failed(old, "engine died", scheduler, [])

    assert calls == [([0], "/resolved/m", config.engine, "abc123", 1)]
    fresh = runner.replicas[0]
    assert fresh is not old and fresh.restarts == 1 and fresh.served == 7 and fresh.generation == 1
    assert old.model.down and not old.alive
