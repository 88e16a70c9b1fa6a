"""`pagedllm bench --compare-vllm-python`: the driver protocol, alternation, the ratio and the
greedy agreement, against a stand-in interpreter that speaks the protocol with `transformers`
(the real vLLM is not installed in the test environment)."""

from __future__ import annotations

import stat
import sys

import pytest

from pagedllm.cli.bench import bench_workload, run_bench

# A fake "python": ignores the driver path it is given and answers like vllm_driver.py, its
# greedy tokens computed by transformers on the exported checkpoint. FAKE_VLLM_MODE=flip
# changes one prompt's tokens, =crash dies during loading. The tokens are kept in
# FAKE_VLLM_CACHE keyed by the workload, so only the first test of the module pays for
# importing torch and transformers in the stand-in.
FAKE = """#!{python}
import json, os, sys
MARKER = "PAGEDLLM-JSON "
print("INFO 00:00 vLLM-like log line on stdout", flush=True)
workload = json.loads(sys.stdin.readline())
if os.environ.get("FAKE_VLLM_MODE") == "crash":
    sys.stderr.write("RuntimeError: no CPU backend here\\n")
    sys.exit(3)
key = json.dumps([workload["prompts"], workload["max_tokens"]])
cache = os.environ["FAKE_VLLM_CACHE"]
cached = json.load(open(cache)) if os.path.exists(cache) else {{}}
if key in cached:
    outputs = cached[key]
else:
    import torch, transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(workload["model"])
    outputs = []
    # plain greedy loop: EOS is generated like any token and does not stop (vLLM's ignore_eos;
    # generate's min_new_tokens would forbid it instead)
    with torch.no_grad():
        for ids, n in zip(workload["prompts"], workload["max_tokens"]):
            seq = list(ids)
            for _ in range(n):
                seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
            outputs.append(seq[len(ids):])
    with open(cache, "w") as f:
        json.dump({{key: outputs}}, f)
if os.environ.get("FAKE_VLLM_MODE") == "flip":
    outputs[0][-1] += 1
with open(os.environ["FAKE_VLLM_LOG"], "a") as log:
    log.write("ready\\n")
print(MARKER + json.dumps({{"ready": True, "version": "fake-0.0"}}), flush=True)
for line in sys.stdin:
    if json.loads(line).get("cmd") != "run":
        break
    with open(os.environ["FAKE_VLLM_LOG"], "a") as log:
        log.write("run\\n")
    reply = {{"elapsed_s": 0.5, "generated_tokens": sum(map(len, outputs)), "outputs": outputs}}
    print(MARKER + json.dumps(reply), flush=True)
"""

ENGINE = dict(device="cpu", max_model_len=64)


@pytest.fixture(scope="module")
def greedy_cache(tmp_path_factory):
    """Where the stand-in keeps transformers' greedy tokens between this module's tests."""
    return tmp_path_factory.mktemp("fake-vllm") / "greedy.json"


@pytest.fixture
def fake_python(tmp_path, monkeypatch, greedy_cache):
    path = tmp_path / "fake-python"
    path.write_text(FAKE.format(python=sys.executable))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("FAKE_VLLM_LOG", str(tmp_path / "log"))
    monkeypatch.setenv("FAKE_VLLM_CACHE", str(greedy_cache))
    return path


def _bench(python, **kw):
    return run_bench(
        engine_kwargs=ENGINE,
        num_prompts=3,
        input_len=10,
        output_len=5,
        min_input_len=4,
        min_output_len=2,
        compare_vllm_python=str(python),
        **kw,
    )


def test_vllm_runs_alternate_and_agreement_counts_identical_greedy_outputs(fake_python):
    result = _bench(fake_python, rounds=2)
    assert (fake_python.parent / "log").read_text().split() == ["ready", "run", "run"]
    vllm = result["vllm"]
    assert vllm["version"] == "fake-0.0" and len(vllm["output_tokens_per_s_runs"]) == 2
    assert vllm["output_tokens_per_s"] == result["generated_tokens"] / 0.5
    assert result["speedup_vs_vllm"] == pytest.approx(
        result["output_tokens_per_s"] / vllm["output_tokens_per_s"]
    )
    assert result["greedy_agreement_vs_vllm"] == "3/3"
    assert "pagedllm / vLLM =" in result["summary"] and "agreement 3/3" in result["summary"]


def test_with_an_even_count_of_rounds_the_rate_is_the_median_of_the_rounds(fake_python):
    result = _bench(fake_python, rounds=2)
    rates = result["output_tokens_per_s_runs"]
    assert result["output_tokens_per_s"] == pytest.approx((rates[0] + rates[1]) / 2)


def test_a_differing_output_lowers_the_agreement(fake_python, monkeypatch):
    monkeypatch.setenv("FAKE_VLLM_MODE", "flip")
    assert _bench(fake_python)["greedy_agreement_vs_vllm"] == "2/3"


def test_a_vllm_that_dies_is_reported_with_its_stderr(fake_python, monkeypatch):
    monkeypatch.setenv("FAKE_VLLM_MODE", "crash")
    with pytest.raises(RuntimeError, match="exited with status 3(.|\\n)*no CPU backend here"):
        _bench(fake_python)


def test_a_missing_interpreter_is_a_value_error_before_any_model_loads(tmp_path, monkeypatch):
    def no_engine(*args, **kwargs):
        raise AssertionError("the engine was built before the interpreter was checked")

    monkeypatch.setattr("pagedllm.LLM", no_engine)
    with pytest.raises(ValueError, match="no such executable"):
        _bench(tmp_path / "no-python")


def test_workload_lengths_are_drawn_within_the_bounds_and_reproducible():
    prompts, max_tokens = bench_workload(50, 256, 256, 1000, 0, 32, 16)
    assert all(32 <= len(p) <= 256 for p in prompts) and len({len(p) for p in prompts}) > 10
    assert all(16 <= n <= 256 for n in max_tokens)
    assert bench_workload(50, 256, 256, 1000, 0, 32, 16) == (prompts, max_tokens)
    with pytest.raises(ValueError, match="--min-input-len 300 must be in"):
        bench_workload(5, 256, 16, 1000, 0, 300)
