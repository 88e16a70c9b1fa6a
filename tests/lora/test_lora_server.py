"""`pagedllm serve --lora-modules NAME=PATH`: each adapter is a model id of its own in
/v1/models, `model` picks it (greedy output equal to transformers + peft), an unknown model is
a 404, and a bad adapter folder stops the server from starting."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from pagedllm.cli.app import build_parser
from pagedllm.entrypoints.api_server import ServerConfig, build_server_app

from lora_util import MAX_NEW, PROMPTS


def app_for(world, **modules):
    engine = dict(
        model=str(world.base), device="cpu", dtype="float32", block_size=4, max_model_len=64,
        enable_lora=True, max_loras=2, max_lora_rank=8,
    )  # fmt: skip
    return build_server_app(engine, ServerConfig(served_model_name="base", lora_modules=modules))


@pytest.fixture(scope="module")
def client(llama_world):
    modules = {name: r.lora_path for name, r in llama_world.requests.items()}
    with TestClient(app_for(llama_world, **modules)) as client:
        yield client


def test_adapters_are_models_of_their_own(client, llama_world):
    cards = client.get("/v1/models").json()["data"]
    assert [c["id"] for c in cards] == ["base", "alpha", "beta"]
    assert all(c["parent"] == "base" for c in cards[1:])
    assert cards[1]["root"] == llama_world.requests["alpha"].lora_path
    assert client.app.state.server.engine.engine.list_loras() == {1, 2}  # loaded at startup


@pytest.mark.parametrize("model", ["base", "alpha", "beta"])
def test_model_selects_the_adapter(client, llama_world, model):
    body = dict(prompt=PROMPTS[1], max_tokens=MAX_NEW, temperature=0, ignore_eos=True, logprobs=0)
    response = client.post("/v1/completions", json={"model": model, **body})
    assert response.status_code == 200, response.text
    data = response.json()
    assert data["model"] == model
    tokenizer = client.app.state.server.engine.tokenizer
    expected = llama_world.expected[(None if model == "base" else model, tuple(PROMPTS[1]))]
    assert data["choices"][0]["logprobs"]["tokens"] == [tokenizer.decode([t]) for t in expected]


def test_unknown_model_is_404(client):
    response = client.post("/v1/completions", json={"model": "gamma", "prompt": [5, 6]})
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["param"] == "model" and "`gamma` does not exist" in error["message"]
    assert "`alpha`" in error["message"]


def test_a_bad_adapter_folder_stops_the_server_from_starting(llama_world, tmp_path):
    with pytest.raises(ValueError, match="LoRA adapter 'broken'.*no such folder"):
        app_for(llama_world, broken=str(tmp_path / "missing"))


def test_serve_parser_takes_lora_modules():
    args = build_parser().parse_args(
        ["serve", "--lora-modules", "a=/x", "b=/y/z", "--max-loras", "2"]
    )
    assert args.lora_modules == [("a", "/x"), ("b", "/y/z")] and args.max_loras == 2
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--lora-modules", "nopath"])
