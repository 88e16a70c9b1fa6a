"""`pagedllm export-tiny`: the tiny model as a checkpoint folder that loads and generates as the
built-in one, its first layers as a draft model, and a LoRA adapter that PEFT reads the same."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedllm import LLM, LoRARequest, SamplingParams
from pagedllm.cli import main
from pagedllm.cli.export_tiny import export_tiny
from pagedllm.tokenizer import BYTE_BOS_ID


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    return export_tiny(tmp_path_factory.mktemp("export") / "tiny", with_adapter=True)


def test_exported_tiny_folder_generates_as_the_built_in_model(exported):
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    knobs = dict(device="cpu", max_model_len=64, num_gpu_blocks=16)
    folder = LLM(model=str(exported["model"]), **knobs).generate(["Hello"], params, use_tqdm=False)
    built_in = LLM(**knobs).generate(["Hello"], params, use_tqdm=False)
    assert folder[0].outputs[0].token_ids == built_in[0].outputs[0].token_ids


def test_exported_adapter_is_the_same_adapter_under_peft(exported):
    from peft import PeftModel

    prompt = [BYTE_BOS_ID, *b"Hello"]
    llm = LLM(model=str(exported["model"]), device="cpu", max_model_len=64, enable_lora=True)
    lora = LoRARequest("tiny", 1, str(exported["adapter"]))
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    base, adapted = llm.generate(
        [{"prompt_token_ids": prompt}] * 2, params, lora_request=[None, lora], use_tqdm=False
    )
    hf = AutoModelForCausalLM.from_pretrained(exported["model"], dtype=torch.float32)
    hf = PeftModel.from_pretrained(hf, exported["adapter"]).eval()
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=8,
            min_new_tokens=8,
            do_sample=False,
        )
    assert adapted.outputs[0].token_ids == out[0, len(prompt) :].tolist()
    assert adapted.outputs[0].token_ids != base.outputs[0].token_ids  # the adapter matters


def test_exported_first_layer_is_a_draft_model_for_the_full_one(exported, tmp_path):
    draft = export_tiny(tmp_path / "draft", num_layers=1)["model"]
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    knobs = dict(model=str(exported["model"]), device="cpu", max_model_len=64, num_gpu_blocks=16)
    speculating = LLM(**knobs, speculative_config=spec)
    out = speculating.generate(["Hello"], params, use_tqdm=False)
    plain = LLM(**knobs).generate(["Hello"], params, use_tqdm=False)
    assert out[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
    assert speculating.llm_engine.get_stats()["spec_decode_num_accepted_tokens"] > 0


def test_export_tiny_refuses_a_folder_that_is_not_empty(exported):
    with pytest.raises(ValueError, match="already exists and is not an empty folder"):
        export_tiny(exported["model"])


def test_export_tiny_command_writes_a_model_and_an_adapter_that_generate(tmp_path, capsys):
    folder = tmp_path / "tiny"
    assert main(["export-tiny", str(folder), "--with-adapter", "--family", "qwen3"]) == 0
    out = capsys.readouterr().out
    assert f"pagedllm generate --model {folder}" in out and f"{folder / 'adapter'}" in out
    llm = LLM(model=str(folder), device="cpu", max_model_len=64, enable_lora=True)
    lora = LoRARequest("tiny", 1, str(folder / "adapter"))
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    outputs = llm.generate(["Hi", "Hi"], params, lora_request=[None, lora], use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [4, 4]
    assert llm.llm_engine.model_config.family == "qwen3"
