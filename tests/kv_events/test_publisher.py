"""KV events from a real engine: one batch per step in vLLM's schema (msgpack over ZMQ PUB, a
sequence number per batch), replay of held batches, a snapshot when they are gone."""

from __future__ import annotations

import time

import msgpack
import numpy as np
import pytest
import zmq

from pagedllm import EngineArgs, LLMEngine, SamplingParams
from pagedllm._core import hash_block_chain
from pagedllm.kv_events import KVEventsConfig
from pagedllm.kv_events.publisher import END_SEQ

BLOCK = 4


def events_config(tmp_path, **extra) -> dict:
    return {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"ipc://{tmp_path}/pub",
        "replay_endpoint": f"ipc://{tmp_path}/replay",
        "topic": "kv",
        **extra,
    }


@pytest.fixture
def engine_factory(tmp_path):
    engines = []

    def make(**extra):
        engine = LLMEngine.from_engine_args(
            EngineArgs(
                device="cpu",
                block_size=BLOCK,
                max_model_len=64,
                num_gpu_blocks=32,
                kv_events_config=events_config(tmp_path, **extra),
            )
        )
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.shutdown()


def subscribe(endpoint: str, topic: str = "kv") -> zmq.Socket:
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
    sub.connect(endpoint)
    time.sleep(0.2)  # ZMQ's slow joiner: let the subscription reach the publisher
    return sub


def run(engine: LLMEngine, prompt: list[int], max_tokens: int = 3, rid: str = "r") -> None:
    engine.add_request(rid, {"prompt_token_ids": prompt}, SamplingParams(max_tokens=max_tokens))
    while engine.has_unfinished_requests():
        engine.step()


def received(sub: zmq.Socket) -> list[tuple[int, list]]:
    out = []
    while sub.poll(300):
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"kv"
        out.append((int.from_bytes(seq, "big"), msgpack.unpackb(payload)))
    return out


def replay(endpoint: str, start: int) -> list[tuple[int, bytes]]:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    sock.send_multipart((b"", start.to_bytes(8, "big")))
    out = []
    try:
        while sock.poll(2000):
            _, seq, payload = sock.recv_multipart()
            if seq == END_SEQ:
                assert payload == b""
                return out
            out.append((int.from_bytes(seq, "big", signed=True), payload))
        raise AssertionError("no end marker")
    finally:
        sock.close()


def test_a_prompts_blocks_are_published_as_block_stored_in_vllms_schema(engine_factory, tmp_path):
    engine = engine_factory()
    sub = subscribe(f"ipc://{tmp_path}/pub")
    prompt = list(range(10, 23))  # 13 tokens: 3 full blocks
    run(engine, prompt)
    batches = received(sub)
    sub.close()
    assert [seq for seq, _ in batches] == list(range(len(batches)))
    ts, events, rank = batches[0][1]
    assert isinstance(ts, float) and rank == 0
    event = events[0]
    assert event == {
        "type": "BlockStored",
        "block_hashes": hash_block_chain(prompt, BLOCK),
        "parent_block_hash": None,
        "token_ids": prompt[:12],
        "block_size": BLOCK,
        "lora_id": None,
        "medium": "GPU",  # vLLM's name for the main KV cache, whatever the device
        "lora_name": None,
        "extra_keys": [None] * 3,
        "group_idx": 0,
    }


def test_a_decode_filled_block_names_its_parent(engine_factory, tmp_path):
    engine = engine_factory()
    sub = subscribe(f"ipc://{tmp_path}/pub")
    run(engine, list(range(10, 18)), max_tokens=6)  # 8 prompt tokens + decode fills block 3
    events = [e for _, batch in received(sub) for e in batch[1]]
    sub.close()
    stored = [e for e in events if e["type"] == "BlockStored"]
    assert len(stored) >= 2
    assert stored[1]["parent_block_hash"] == stored[0]["block_hashes"][-1]


def test_replay_answers_the_held_batches_from_the_asked_number(engine_factory, tmp_path):
    engine = engine_factory()
    run(engine, list(range(10, 19)), rid="a")
    run(engine, list(range(50, 59)), rid="b")
    last = engine.kv_events.seq
    got = replay(f"ipc://{tmp_path}/replay", 1)
    assert [seq for seq, _ in got] == list(range(1, last + 1))


def test_replay_older_than_the_buffer_gets_a_snapshot_of_the_cache(engine_factory, tmp_path):
    engine = engine_factory(buffer_steps=1)
    run(engine, list(range(10, 19)), rid="a")
    run(engine, list(range(50, 59)), rid="b")
    got = replay(f"ipc://{tmp_path}/replay", 0)
    assert len(got) == 1
    seq, payload = got[0]
    assert seq == engine.kv_events.seq
    cleared, stored = msgpack.unpackb(payload)[1]
    assert cleared == {"type": "AllBlocksCleared"}
    # 9 prompt + 2 decoded tokens computed each: each prompt's first two blocks are cached
    cached = hash_block_chain(list(range(10, 19)), BLOCK) + hash_block_chain(
        list(range(50, 59)), BLOCK
    )
    assert sorted(stored["block_hashes"]) == sorted(cached)
    assert stored["token_ids"] == []  # a snapshot lists no tokens


def test_a_lora_requests_blocks_carry_its_adapter_id(tmp_path):
    pytest.importorskip("peft")
    from pagedllm import LoRARequest
    from pagedllm.cli.export_tiny import export_tiny

    written = export_tiny(tmp_path / "tiny", with_adapter=True)
    engine = LLMEngine.from_engine_args(
        EngineArgs(
            model=str(tmp_path / "tiny"),
            device="cpu",
            block_size=BLOCK,
            max_model_len=64,
            num_gpu_blocks=32,
            enable_lora=True,
            kv_events_config=events_config(tmp_path),
        )
    )
    try:
        sub = subscribe(f"ipc://{tmp_path}/pub")
        lora = LoRARequest("tiny", 3, str(written["adapter"]))
        prompt = {"prompt_token_ids": list(range(10, 19))}
        engine.add_request("a", prompt, SamplingParams(max_tokens=2), lora_request=lora)
        while engine.has_unfinished_requests():
            engine.step()
        stored = [e for _, b in received(sub) for e in b[1] if e["type"] == "BlockStored"]
        sub.close()
        assert stored and all(e["lora_id"] == 3 for e in stored)
    finally:
        engine.shutdown()


def test_a_bad_kv_events_config_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="unknown field.*endpont"):
        KVEventsConfig.from_dict({"endpont": "tcp://*:1"})
    with pytest.raises(ValueError, match="publisher must be one of"):
        KVEventsConfig.from_dict({"enable_kv_cache_events": True, "publisher": "kafka"})
    with pytest.raises(ValueError, match="buffer_steps"):
        EngineArgs(kv_events_config={"buffer_steps": 0})


def test_replica_endpoints_are_offset_by_rank():
    config = KVEventsConfig(endpoint="tcp://*:5557", replay_endpoint="tcp://*:5558")
    ranked = config.for_rank(2)
    assert (ranked.endpoint, ranked.replay_endpoint) == ("tcp://*:5559", "tcp://*:5560")


def test_events_off_publish_nothing_and_record_nothing(tmp_path):
    engine = LLMEngine.from_engine_args(
        EngineArgs(device="cpu", block_size=BLOCK, max_model_len=64, num_gpu_blocks=32)
    )
    run(engine, list(range(10, 19)))
    assert engine.kv_events is None
    kinds = engine.scheduler.drain_kv_events()[0]
    assert isinstance(kinds, np.ndarray) and kinds.size == 0
