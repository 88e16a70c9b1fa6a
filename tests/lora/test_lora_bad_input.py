"""Bad LoRA input is a ValueError naming the adapter and the problem, raised before anything
is queued; the engine keeps serving."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pagedllm import LLM, EngineArgs, LoRARequest
from pagedllm.lora.adapter import PROJECTIONS

from lora_util import PARAMS, PROMPTS


@pytest.fixture(scope="module")
def llm(llama_world):
    return llama_world.llm()


def broken(tmp_path: Path, good: LoRARequest, name: str, edit) -> LoRARequest:
    folder = tmp_path / name
    shutil.copytree(good.lora_path, folder)
    edit(folder)
    return LoRARequest(name, 90 + len(name), str(folder))


def set_config(**changes):
    def edit(folder: Path) -> None:
        path = folder / "adapter_config.json"
        config = json.loads(path.read_text())
        config.update(changes)
        path.write_text(json.dumps(config))

    return edit


def poison_weight(value: float):
    """Writes `value` (NaN, inf) into one entry of the adapter's first lora_B matrix."""

    def edit(folder: Path) -> None:
        from safetensors.torch import load_file, save_file

        path = folder / "adapter_model.safetensors"
        tensors = load_file(path)
        name = sorted(k for k in tensors if "lora_B" in k)[0]
        tensors[name][0, 0] = value
        save_file(tensors, path)

    return edit


CASES = {
    "missing": (lambda f: shutil.rmtree(f), "no such folder"),
    "noconfig": (lambda f: (f / "adapter_config.json").unlink(), "no adapter_config.json"),
    "badjson": (lambda f: (f / "adapter_config.json").write_text("{r: 4"), "not readable JSON"),
    "noweights": (
        lambda f: (f / "adapter_model.safetensors").unlink(),
        "no adapter_model.safetensors",
    ),
    "corrupt": (
        lambda f: (f / "adapter_model.safetensors").write_bytes(b"\x00" * 40),
        "not readable",
    ),
    "rank": (set_config(r=32), "rank r=32 exceeds max_lora_rank=8"),
    "shape": (set_config(r=2), "do not fit rank 2"),
    "target": (
        set_config(target_modules=["q_proj", "lm_head"]),
        r"target modules \[.lm_head.\] are not projections",
    ),
    "dora": (set_config(use_dora=True), "use_dora=True is not supported"),
    "bias": (set_config(bias="all"), "bias='all' is not supported"),
    "nan": (poison_weight(float("nan")), r"weight '.*lora_B\.weight' holds NaN or infinite"),
    "inf": (poison_weight(float("inf")), r"weight '.*lora_B\.weight' holds NaN or infinite"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_bad_adapter_is_refused_before_queueing(llm, llama_world, tmp_path, case):
    edit, message = CASES[case]
    bad = broken(tmp_path, llama_world.requests["alpha"], case, edit)
    with pytest.raises(ValueError, match=message) as info:
        llm.generate({"prompt_token_ids": PROMPTS[0]}, PARAMS, lora_request=bad, use_tqdm=False)
    assert repr(case) in str(info.value), "the message names the adapter"
    assert not llm.engine.has_unfinished_requests()
    # the engine keeps serving, with and without adapters
    outs = llm.generate(
        [{"prompt_token_ids": PROMPTS[0]}] * 2,
        PARAMS,
        lora_request=[None, llama_world.requests["alpha"]],
        use_tqdm=False,
    )
    llama_world.check(outs, [(None, tuple(PROMPTS[0])), ("alpha", tuple(PROMPTS[0]))])


def test_unknown_weight_of_a_module_the_model_lacks_is_refused(llm, llama_world, tmp_path):
    from safetensors.torch import load_file, save_file

    def add_embedding(folder: Path) -> None:
        path = folder / "adapter_model.safetensors"
        tensors = load_file(path)
        name = "base_model.model.model.layers.0.mlp.fc1.lora_A.weight"
        tensors[name] = next(iter(tensors.values())).clone()
        save_file(tensors, path)

    bad = broken(tmp_path, llama_world.requests["alpha"], "fc1", add_embedding)
    with pytest.raises(ValueError, match="'fc1'.*not a projection this model adapts"):
        llm.generate({"prompt_token_ids": PROMPTS[0]}, PARAMS, lora_request=bad, use_tqdm=False)
    assert all(p in str(PROJECTIONS) for p in ("q_proj", "down_proj"))


def test_lora_request_without_enable_lora_is_refused(llama_world):
    llm = LLM(str(llama_world.base), dtype="float32", device="cpu", block_size=4)
    alpha_id = llama_world.requests["alpha"].lora_int_id
    with pytest.raises(ValueError, match=f"lora_id={alpha_id} given but LoRA is not enabled"):
        llm.generate(
            {"prompt_token_ids": PROMPTS[0]},
            PARAMS,
            lora_request=llama_world.requests["alpha"],
            use_tqdm=False,
        )
    assert not llm.engine.has_unfinished_requests()


def test_one_id_names_one_adapter(llm, llama_world):
    alpha, beta = llama_world.requests["alpha"], llama_world.requests["beta"]
    llm.engine.add_lora(alpha)  # known to the engine whatever ran before
    clash = LoRARequest("impostor", alpha.lora_int_id, beta.lora_path)
    with pytest.raises(ValueError, match="'impostor'.*already names adapter 'alpha'"):
        llm.generate({"prompt_token_ids": PROMPTS[0]}, PARAMS, lora_request=clash, use_tqdm=False)
    with pytest.raises(TypeError, match="must be a LoRARequest"):
        llm.engine.add_request("x", {"prompt_token_ids": PROMPTS[0]}, lora_request="alpha")
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize(
    "fields, message",
    [
        (("", 1, "/x"), "lora_name must be a non-empty str"),
        (("a", 0, "/x"), "lora_int_id must be an int in \\[1, 2\\*\\*63\\)"),
        (("a", True, "/x"), "lora_int_id"),
        (("a", 1, 5), "lora_path must be a folder path"),
    ],
)
def test_lora_request_checks_its_fields(fields, message):
    with pytest.raises(ValueError, match=message):
        LoRARequest(*fields)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_loras": 0}, "max_loras must be a positive integer"),
        ({"max_lora_rank": -1}, "max_lora_rank must be a positive integer"),
        ({"max_loras": 4, "max_cpu_loras": 2}, "max_cpu_loras \\(2\\) must be >= max_loras"),
    ],
)
def test_engine_args_check_the_lora_knobs(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(enable_lora=True, **kwargs)


def test_an_adapter_whose_folder_vanished_after_loading_fails_only_its_requests(
    llama_world, tmp_path
):
    w = llama_world
    gone = broken(tmp_path, w.requests["alpha"], "gone", lambda folder: None)
    beta = w.requests["beta"]
    engine = w.llm(max_loras=1, max_cpu_loras=1).llm_engine
    # arrival order: the first step holds the base requests and `gone`'s
    requests = [(None, PROMPTS[0]), (gone, PROMPTS[1]), (None, PROMPTS[2]), (beta, PROMPTS[0])]
    for i, (lora, prompt) in enumerate(requests):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, PARAMS, lora_request=lora)
    # `beta` took the one host place: `gone` must be read from its folder again, now deleted
    shutil.rmtree(gone.lora_path)
    finals = {}
    while engine.has_unfinished_requests():
        finals.update((o.request_id, o) for o in engine.step() if o.finished)
    lost = finals["1"].outputs[0]
    assert lost.finish_reason == "abort"
    assert "'gone'" in lost.stop_reason and "no such folder" in lost.stop_reason
    w.check(
        [finals[i] for i in "023"],
        [(None, tuple(PROMPTS[0])), (None, tuple(PROMPTS[2])), ("beta", tuple(PROMPTS[0]))],
    )
    assert not engine.requests and engine.scheduler.get_stats()["num_rolled_back_steps"] == 1
