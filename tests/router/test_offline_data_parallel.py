"""`LLM(data_parallel_size=2)`: two engine processes behind the router core. Greedy outputs equal
one engine's, in the caller's order (beam searches too, each one's beams on one replica);
prompts sharing a prefix go to one replica; a refused prompt raises the replica's error and
leaves the replicas usable; a killed replica is named in the error and the rest are stopped;
close() and deletion leave no process or socket folder."""

from __future__ import annotations

import gc
import os
import signal
from pathlib import Path

import pytest
from router_util import MODEL, leftover_sockets, wait_for

from pagedllm import LLM, SamplingParams
from pagedllm._core import hash_block_chain
from pagedllm.router.offline import ReplicaDiedError
from pagedllm.sampling_params import BeamSearchParams

ENGINE = {"max_model_len": 256, "num_gpu_blocks": 64, "cpu_threads": 1, "block_size": 16}
GREEDY = SamplingParams(max_tokens=6, temperature=0)
PREFIX_A = "You are a careful assistant who answers in one short line. " * 2
PREFIX_B = "Translate each sentence below into French, keeping the names. " * 2
PROMPTS = [PREFIX_A + f"Question {i}?" for i in range(3)] + [
    PREFIX_B + f"Sentence {i}." for i in range(3)
]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"


@pytest.fixture(scope="module")
def dp_llm():
    llm = LLM(MODEL, data_parallel_size=2, **ENGINE)
    yield llm
    llm.close()


def test_outputs_equal_one_engines_greedy_outputs_in_the_callers_order(dp_llm):
    outputs = dp_llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    single = LLM(MODEL, **ENGINE).generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.prompt for o in outputs] == PROMPTS
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in single]
    ids = [int(o.request_id) for o in outputs]
    assert ids == list(range(ids[0], ids[0] + len(PROMPTS)))


def test_beam_searches_spread_over_the_replicas_equal_one_engines_in_order(dp_llm):
    params = BeamSearchParams(beam_width=3, max_tokens=5)
    before = [s["routed"] for s in dp_llm.replicas.router.stats()]
    outputs = dp_llm.beam_search(PROMPTS, params)
    routed = [s["routed"] - b for s, b in zip(dp_llm.replicas.router.stats(), before)]
    single = LLM(MODEL, **ENGINE).beam_search(PROMPTS, params)
    assert routed[0] > 0 and routed[1] > 0 and sum(routed) == len(PROMPTS)
    for output, expected in zip(outputs, single, strict=True):
        assert [b.tokens for b in output.sequences] == [b.tokens for b in expected.sequences]
        assert [b.text for b in output.sequences] == [b.text for b in expected.sequences]
        assert [b.cum_logprob for b in output.sequences] == pytest.approx(
            [b.cum_logprob for b in expected.sequences], abs=1e-4
        )


def test_a_refused_beam_search_raises_the_replicas_error_naming_beam_width(dp_llm):
    with pytest.raises(ValueError, match="beam_width=1000"):
        dp_llm.beam_search(PROMPTS[:2], BeamSearchParams(beam_width=1000, max_tokens=2))
    assert len(dp_llm.beam_search(PROMPTS[:2], BeamSearchParams(beam_width=2, max_tokens=2))) == 2


def test_chat_runs_on_the_replicas_as_on_one_engine(dp_llm):
    conversation = [{"role": "user", "content": "Hello there"}]
    reply = dp_llm.chat(conversation, GREEDY, use_tqdm=False)[0]
    single = LLM(MODEL, **ENGINE).chat(conversation, GREEDY, use_tqdm=False)[0]
    assert reply.outputs[0].token_ids == single.outputs[0].token_ids


def test_prompts_sharing_a_prefix_go_to_one_replica(dp_llm):
    dp_llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    router, tokenizer = dp_llm.replicas.router, dp_llm.get_tokenizer()
    firsts = [hash_block_chain(tokenizer.encode(p), 16)[0] for p in (PREFIX_A, PREFIX_B)]

    def holders(h):
        return [r for r in range(2) if h in set(router.replica_hashes(r).tolist())]

    wait_for(lambda: all(holders(h) for h in firsts), what="the replicas' KV events")
    assert [len(holders(h)) for h in firsts] == [1, 1]
    assert holders(firsts[0]) != holders(firsts[1])  # the two groups are spread


def test_a_refused_prompt_raises_the_replicas_error_and_the_replicas_stay_usable(dp_llm):
    with pytest.raises(ValueError, match="prompt_token_ids"):
        dp_llm.generate([PROMPTS[0], {"prompt": "no ids"}], GREEDY, use_tqdm=False)
    assert len(dp_llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)) == 2


def test_llm_engine_is_refused_with_replicas_in_other_processes(dp_llm):
    with pytest.raises(AttributeError, match="2 data-parallel replicas"):
        dp_llm.llm_engine  # noqa: B018


def test_the_ray_backend_is_refused_naming_serve():
    with pytest.raises(ValueError, match="Ray replicas are for `pagedllm serve -dp`"):
        LLM(MODEL, data_parallel_size=2, data_parallel_backend="ray", **ENGINE)


def test_a_killed_replica_is_named_and_the_others_are_stopped():
    llm = LLM(MODEL, data_parallel_size=2, **ENGINE)
    pids, folder = llm.replicas.pids(), llm.replicas.folder
    os.kill(pids[1], signal.SIGKILL)
    with pytest.raises(ReplicaDiedError, match=rf"replica 1 \(pid {pids[1]}\) died"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert not any(alive(pid) for pid in pids)
    assert not leftover_sockets(folder)
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)


def test_deleting_the_llm_stops_its_replicas_and_removes_their_sockets():
    llm = LLM(MODEL, data_parallel_size=2, **ENGINE)
    pids, folder = llm.replicas.pids(), llm.replicas.folder
    assert all(alive(pid) for pid in pids) and leftover_sockets(folder)
    del llm
    gc.collect()
    assert not any(alive(pid) for pid in pids)
    assert not leftover_sockets(folder)


def test_a_generate_call_gives_back_every_requests_uncached_tokens(dp_llm):
    dp_llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    stats = dp_llm.replicas.router.stats()
    assert [(s["in_flight"], s["uncached_tokens"]) for s in stats] == [(0, 0), (0, 0)]
    assert sum(s["routed"] for s in stats) >= len(PROMPTS)
