"""The heap is frozen after start-up (`freeze_heap`): the garbage collector's full collections
walk only what the steps allocate, not the ~330K objects of torch, the model and the tokenizer."""

from __future__ import annotations

import gc
import subprocess
import sys
import weakref

from pagedllm import EngineArgs, LLMEngine, SamplingParams

ARGS = dict(model="pagedllm/tiny-random", max_model_len=64, num_gpu_blocks=16)


def test_engine_start_freezes_the_heap():
    gc.unfreeze()
    engine = LLMEngine(EngineArgs(**ARGS))
    assert gc.get_freeze_count() > 100_000  # torch's and the model's objects among them
    engine.add_request("a", "hi", SamplingParams(max_tokens=3))
    while engine.has_unfinished_requests():
        engine.step()


def test_an_engine_is_still_freed_once_dropped():
    engine = LLMEngine(EngineArgs(**ARGS))
    model, cache = weakref.ref(engine.model), weakref.ref(engine.cache_engine)
    del engine  # frozen, but not in a cycle: reference counting frees it
    assert model() is None and cache() is None


def test_the_heap_is_unfrozen_at_exit():
    # atexit runs handlers last-registered first: this one runs after the engine's unfreeze
    code = (
        "import atexit, gc; from pagedllm import EngineArgs, LLMEngine; "
        "atexit.register(lambda: print('frozen at exit', gc.get_freeze_count())); "
        f"LLMEngine(EngineArgs(**{ARGS!r})); print('frozen', gc.get_freeze_count() > 0)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[:2] == ["frozen True", "frozen at exit 0"]
