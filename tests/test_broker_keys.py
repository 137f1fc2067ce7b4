import pytest

from broker.keys import EngineState, RedisKeys


def test_default_layout():
    k = RedisKeys()
    assert k.request_stream("e0") == "rs:req:e0"
    assert k.consumer_group == "engine"
    assert k.output_channel("c1") == "rs:out:c1"
    assert k.engine("e0") == "rs:engine:e0"
    assert k.engine_alive("e0") == "rs:engine:e0:alive"
    assert k.engines() == "rs:engines"
    assert k.client_alive("c1") == "rs:client:c1:alive"
    assert k.clients() == "rs:clients"
    assert k.lb() == "rs:lb"
    assert k.wave() == "rs:wave"
    assert k.coordinator_lock() == "rs:coordinator:lock"
    assert k.batch("b1") == "rs:batch:b1"
    assert k.batch_items("b1") == "rs:batch:b1:items"


def test_prefix_applies_everywhere():
    k = RedisKeys(prefix="prod")
    names = [k.request_stream("e"), k.output_channel("c"), k.engine("e"), k.engines(), k.lb(), k.wave()]
    assert all(n.startswith("prod:") for n in names)


@pytest.mark.parametrize("bad", ["", "a:b", "a b", "x\n", None])
def test_bad_ids_are_rejected(bad):
    with pytest.raises(ValueError):
        RedisKeys().engine(bad)
    with pytest.raises(ValueError):
        RedisKeys(prefix=bad)


def test_engine_state_is_a_str_enum():
    assert EngineState.READY == "ready"
    assert str(EngineState.DRAINING) == "draining"
    assert f"{EngineState.STARTING}" == "starting"
    assert EngineState("dead") is EngineState.DEAD
