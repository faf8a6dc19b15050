"""A weight load while a request holds KV marks it stale_context: its later tokens attend to positions read by
older weights, so the trainer leaves it out of the same-weights mismatch figure."""

from flashreinforce.models import build_model
from flashreinforce.rollout.engine import Engine
from flashreinforce.types import SamplingParams


def test_in_flight_load_marks_running_requests_and_not_later_ones():
    model = build_model(30, 32, 1, 2, 64, eos_token_id=1)
    engine = Engine(model, max_batch_size=2, max_context=60, eos_token_ids=1)
    params = SamplingParams(max_new_tokens=50, seed=0, stop_token_ids=())
    engine.submit("running", [3, 4, 5], params)
    engine.step()
    engine.load_weights(model.state_dict(), version=0)  # same version: nothing changed, nothing stale
    engine.load_weights({k: v + 0.01 for k, v in model.state_dict().items()}, version=1)
    engine.submit("later", [3, 4, 5], params)
    (running,) = engine.abort(["running"])
    assert running.stale_context
    engine.submit("running", [3, 4, 5], params, prefix=running)  # re-read, but its first token stays stale
    done = {}
    while engine.has_work:
        done.update({g.request_id: g for g in engine.step()})
    assert done["running"].stale_context and not done["later"].stale_context
    assert set(done["later"].policy_versions) == {1}


def test_waiting_requests_are_not_marked():
    model = build_model(30, 32, 1, 2, 64, eos_token_id=1)
    engine = Engine(model, max_batch_size=1, max_context=60, eos_token_ids=1)
    engine.submit("a", [3, 4], SamplingParams(max_new_tokens=3, seed=0))
    engine.submit("b", [3, 4], SamplingParams(max_new_tokens=3, seed=1))
    engine.step()  # a runs, b waits without KV
    engine.load_weights({k: v * 1.0 for k, v in model.state_dict().items()}, version=1)
    done = {}
    while engine.has_work:
        done.update({g.request_id: g for g in engine.step()})
    assert done["a"].stale_context and not done["b"].stale_context
