import pytest
from redis.crc import key_slot

from broker.keys import EngineState, RedisKeys


def test_default_layout():
    k = RedisKeys()
    assert k.request_stream("e0") == "rs:req:{e0}"
    assert k.consumer_group == "engine"
    assert k.output_channel("c1") == "rs:out:{c1}"
    assert k.engine("e0") == "rs:engine:{e0}"
    assert k.engine_alive("e0") == "rs:engine:{e0}:alive"
    assert k.engine_blocks("e0") == "rs:engine:{e0}:blocks"
    assert k.engines() == "{rs}:engines"
    assert k.client_alive("c1") == "{rs}:client:c1:alive"
    assert k.clients() == "{rs}:clients"
    assert k.lb() == "{rs}:lb"
    assert k.wave() == "{rs}:wave"
    assert k.coordinator_lock() == "{rs}:coordinator:lock"
    assert k.batch("b1") == "{rs}:batch:b1"
    assert k.batch_items("b1") == "{rs}:batch:b1:items"


def test_prefix_applies_everywhere():
    k = RedisKeys(prefix="prod")
    names = [k.request_stream("e"), k.output_channel("c"), k.engine("e"), k.engines(), k.lb(), k.wave()]
    assert all(n.startswith(("prod:", "{prod}:")) for n in names)


def _slots(names):
    return {key_slot(n.encode()) for n in names}


def test_one_engine_keys_share_a_slot():
    k = RedisKeys()
    names = [*k.engine_keys("3"), k.engine_presence("3", "abc"), k.engine_rendezvous("3", "n1") + "x"]
    assert len(_slots(names)) == 1
    assert len(_slots(k.engine_keys(str(e))[0] for e in range(16))) > 1  # engines spread over slots


def test_control_keys_share_a_slot():
    """Everything the coordinator's transactions and scripts, and the batch scripts, touch together."""
    k = RedisKeys()
    names = [k.engines(), k.routing(), k.client_alive("c1"), k.clients(), k.lb(), k.wave(), k.coordinator_lock(),
             k.coordinator(), k.batch("b"), k.batch_items("b"), k.batch_results("b"), k.batch_claims("b"),
             k.batches(), k.batch_sweeper_lock(), k.stack_restarts()]
    assert len(_slots(names)) == 1


@pytest.mark.parametrize("bad", ["", "a:b", "a b", "x\n", "a{b", "a}b", None])
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
