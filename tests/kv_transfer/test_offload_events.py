"""The offload tiers publish KV events too (vLLM's `medium`): the host tier's saved blocks as
`BlockStored` on `CPU`, the disk tier's on `STORAGE` (no tokens, as vLLM's offloading
connector), so a router subscribed to the replica finds a prefix the device cache let go in its
tier instead of counting it as recompute."""

from __future__ import annotations

import threading
import time

import msgpack
import pytest
import zmq
from kv_transfer_util import block_files, make_disk_llm, prompt

from pagedllm import LLM, SamplingParams
from pagedllm._core import Router, hash_block_chain, kv_block_file_name
from pagedllm.kv_events.subscriber import KVEventSubscriber

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
BLOCK = 4


def events_config(folder) -> dict:
    return {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"ipc://{folder}/pub",
        "replay_endpoint": f"ipc://{folder}/replay",
    }


def host_tier_llm(folder) -> LLM:
    """A 24-block device cache (two 48-token prompts) over a host tier, publishing events."""
    return LLM(
        device="cpu",
        block_size=BLOCK,
        num_gpu_blocks=24,
        swap_space=0.01,
        max_model_len=80,
        kv_offloading_size=0.01,
        kv_events_config=events_config(folder),
    )


def serve(llm: LLM, tokens: list[int]) -> None:
    """One request, then steps until its saves are reported (the tier's stored events)."""
    llm.generate({"prompt_token_ids": tokens}, GREEDY, use_tqdm=False)
    while llm.llm_engine.has_unfinished_requests():
        llm.llm_engine.step()


def subscribe(folder) -> zmq.Socket:
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"ipc://{folder}/pub")
    time.sleep(0.2)  # ZMQ's slow joiner
    return sub


def tier_stores(sub: zmq.Socket, medium: str) -> list[int]:
    """Hashes of the `BlockStored` events on `medium` that list no tokens (a tier's)."""
    out = []
    while sub.poll(300):
        _, _, payload = sub.recv_multipart()
        for event in msgpack.unpackb(payload)[1]:
            if event["type"] == "BlockStored" and event["medium"] == medium:
                out += event["block_hashes"] if not event["token_ids"] else []
    return out


def stored_media(sub: zmq.Socket) -> set[tuple[str, bool]]:
    """(medium, whether it lists tokens) of each `BlockStored` event received."""
    out = set()
    while sub.poll(300):
        _, _, payload = sub.recv_multipart()
        for event in msgpack.unpackb(payload)[1]:
            if event["type"] == "BlockStored":
                out.add((event["medium"], bool(event["token_ids"])))
    return out


def evicting_disk_llm(tmp_path) -> tuple:
    """(its folder, an engine over a disk tier of 16 block files publishing events): the second
    of two 12-block prompts evicts."""
    folder = tmp_path / "blocks"
    folder.mkdir()
    llm = make_disk_llm(folder, kv_events_config=events_config(tmp_path))
    llm.llm_engine.kv_transfer.size_bytes = 16 * llm.llm_engine.kv_transfer.file_bytes(0)
    return folder, llm


def storage_removed(sub: zmq.Socket) -> list[int]:
    """The hashes of every `BlockRemoved` on `STORAGE` received until the socket falls quiet."""
    removed = []
    while sub.poll(300):
        for event in msgpack.unpackb(sub.recv_multipart()[2])[1]:
            if event["type"] == "BlockRemoved" and event["medium"] == "STORAGE":
                removed += event["block_hashes"]
    return removed


def wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_a_tiers_saved_blocks_are_published_on_its_medium(tmp_path, tier):
    if tier == "host":
        llm, medium = host_tier_llm(tmp_path), "CPU"
    else:
        blocks = tmp_path / "blocks"
        blocks.mkdir()
        llm = make_disk_llm(blocks, kv_events_config=events_config(tmp_path))
        medium = "STORAGE"
    try:
        sub = subscribe(tmp_path)
        tokens = prompt(1)
        serve(llm, tokens)
        stored = tier_stores(sub, medium)
        sub.close()
        assert set(hash_block_chain(tokens, BLOCK)) <= set(stored)
    finally:
        llm.llm_engine.shutdown()


def test_a_router_finds_a_prefix_the_device_let_go_in_the_host_tier(tmp_path):
    llm = host_tier_llm(tmp_path)
    router, lock = Router(2, BLOCK), threading.Lock()
    sub = KVEventSubscriber(
        router, lock, 0, f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay"
    ).start()
    try:
        wait_for(lambda: sub.replays == 1)
        time.sleep(0.2)  # the SUB socket's subscription reaches the publisher
        first = prompt(1)
        for seed in (1, 2, 3):  # the later prompts evict the first from the device
            serve(llm, prompt(seed))
        publisher = llm.llm_engine.kv_events
        wait_for(lambda: router.next_seq(0) == publisher.seq + 1)
        evicted = set(hash_block_chain(first, BLOCK)) - set(router.replica_hashes(0).tolist())
        assert evicted, "the device no longer holds all of the first prompt"
        assert router.stats()[0]["host_tier_blocks"] >= len(evicted)
        replica, matched, eligible, _, _ = router.route(first + [7])
        assert (replica, matched) == (0, eligible)
    finally:
        sub.close()
        llm.llm_engine.shutdown()


def test_a_cpu_engines_cache_and_host_tier_publish_apart_and_weigh_as_device_and_host(tmp_path):
    """vLLM names the main KV cache `GPU` on every platform: a CPU engine's device blocks are
    `GPU`, its host tier's `CPU`, and a router prefers a replica holding a prefix on its device
    (1.0 a block) to one holding it in its host tier (0.8)."""
    tiered_dir, plain_dir = tmp_path / "tiered", tmp_path / "plain"
    tiered_dir.mkdir(), plain_dir.mkdir()
    tiered = host_tier_llm(tiered_dir)
    plain = LLM(
        device="cpu",
        block_size=BLOCK,
        num_gpu_blocks=24,
        swap_space=0.01,
        max_model_len=80,
        kv_events_config=events_config(plain_dir),
    )
    router, lock = Router(2, BLOCK), threading.Lock()
    subs = [
        KVEventSubscriber(router, lock, i, f"ipc://{d}/pub", f"ipc://{d}/replay").start()
        for i, d in enumerate((tiered_dir, plain_dir))
    ]
    raws = [subscribe(tiered_dir), subscribe(plain_dir)]
    try:
        wait_for(lambda: all(s.replays == 1 for s in subs))
        time.sleep(0.2)  # the SUB sockets' subscriptions reach the publishers
        first = prompt(1)
        for seed in (1, 2, 3):  # the tiered engine's device lets the first prompt go
            serve(tiered, prompt(seed))
        serve(plain, first)
        # (medium, lists tokens): the device's blocks list theirs, a tier's none
        assert stored_media(raws[0]) == {("GPU", True), ("CPU", False)}
        assert stored_media(raws[1]) == {("GPU", True)}
        for i, llm in enumerate((tiered, plain)):
            seq = llm.llm_engine.kv_events.seq
            wait_for(lambda i=i, seq=seq: router.next_seq(i) == seq + 1)
        blocks = set(hash_block_chain(first, BLOCK))
        held = set(router.replica_hashes(0).tolist())
        assert not blocks <= held and router.stats()[0]["host_tier_blocks"] > 0
        assert blocks <= set(router.replica_hashes(1).tolist())
        assert router.stats()[1]["host_tier_blocks"] == 0
        replica, matched, eligible, _, _ = router.route(first + [7])
        assert (replica, matched) == (1, eligible)
    finally:
        for sub in [*raws, *subs]:
            sub.close()
        tiered.llm_engine.shutdown()
        plain.llm_engine.shutdown()


def test_blocks_the_disk_tier_evicts_are_published_removed_and_leave_the_routers_index(tmp_path):
    folder, llm = evicting_disk_llm(tmp_path)
    router, lock = Router(1, BLOCK), threading.Lock()
    sub = KVEventSubscriber(
        router, lock, 0, f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay"
    ).start()
    raw = subscribe(tmp_path)
    try:
        wait_for(lambda: sub.replays == 1)
        time.sleep(0.2)  # the SUB socket's subscription reaches the publisher
        for seed in (1, 2):  # 12 blocks each
            serve(llm, prompt(seed))
        removed = storage_removed(raw)
        on_disk = {p.name for p in block_files(folder)}
        assert removed and len(on_disk) <= 16
        assert not {kv_block_file_name(h) for h in removed} & on_disk
        publisher = llm.llm_engine.kv_events
        wait_for(lambda: router.next_seq(0) == publisher.seq + 1)
        assert router.stats()[0]["disk_tier_blocks"] == len(on_disk)
    finally:
        raw.close()
        sub.close()
        llm.llm_engine.shutdown()


def test_the_disk_tiers_removed_blocks_are_the_evictions_its_saves_report(tmp_path):
    # the scheduler's side publishes what the workers deleted, not what a listing misses
    folder, llm = evicting_disk_llm(tmp_path)
    tier = llm.llm_engine.kv_transfer
    reported, finished = [], tier.get_finished

    def recorded():
        out = finished()
        reported.extend(out[3])
        return out

    tier.get_finished = recorded
    raw = subscribe(tmp_path)
    try:
        time.sleep(0.2)  # the SUB socket's subscription reaches the publisher
        for seed in (1, 2):  # 12 blocks each
            serve(llm, prompt(seed))
        removed = storage_removed(raw)
        assert reported and sorted(removed) == sorted(reported)
        assert not {kv_block_file_name(h) for h in reported} & {p.name for p in block_files(folder)}
    finally:
        raw.close()
        llm.llm_engine.shutdown()
