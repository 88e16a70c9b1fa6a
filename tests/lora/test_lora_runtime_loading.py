"""Adapters loaded and unloaded while serving (vLLM's `POST /v1/load_lora_adapter` and
`/v1/unload_lora_adapter`): listed in /v1/models at once, greedy output equal to transformers +
peft, gone at once when unloaded (404, as vLLM), allowed only with the opt-in, failing loads
4xx naming the problem with nothing changed, and a load during a stream leaves it intact."""

from __future__ import annotations

import json
import shutil
import threading

import pytest
from fastapi.testclient import TestClient

from pagedllm.entrypoints.api_server import ServerConfig, build_server_app
from pagedllm.entrypoints.lora_routes import (
    ENV_FLAG,
    runtime_lora_updating_allowed,
)

from lora_util import MAX_NEW, PROMPTS, save_peft_adapter

LOAD, UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"
GREEDY = dict(prompt=PROMPTS[1], max_tokens=MAX_NEW, temperature=0, ignore_eos=True, logprobs=0)


def app_for(world, *, allow: bool = True, enable_lora: bool = True, **modules):
    engine = dict(
        model=str(world.base), device="cpu", dtype="float32", block_size=4, max_model_len=64,
        enable_lora=enable_lora, max_loras=2, max_lora_rank=8,
    )  # fmt: skip
    config = ServerConfig(
        served_model_name="base", lora_modules=modules, allow_runtime_lora_updating=allow
    )
    return build_server_app(engine, config)


@pytest.fixture(scope="module")
def client(llama_world):
    # "beta" is served from the start: the runtime ids must not collide with its id 1
    with TestClient(app_for(llama_world, beta=llama_world.requests["beta"].lora_path)) as client:
        yield client


def model_ids(client) -> list[str]:
    return [card["id"] for card in client.get("/v1/models").json()["data"]]


def greedy_tokens(client, model: str) -> list[str]:
    response = client.post("/v1/completions", json={"model": model, **GREEDY})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["logprobs"]["tokens"]


def expected_tokens(client, world, adapter: str | None) -> list[str]:
    tokenizer = client.app.state.server.engine.tokenizer
    return [tokenizer.decode([t]) for t in world.expected[(adapter, tuple(PROMPTS[1]))]]


def load(client, name: str, path: str, **extra):
    return client.post(LOAD, json={"lora_name": name, "lora_path": path, **extra})


def served_state(client) -> tuple[list[str], set[int]]:
    return model_ids(client), client.app.state.server.engine.engine.list_loras()


def test_a_loaded_adapter_is_listed_at_once_and_gives_its_greedy_output(client, llama_world):
    response = load(client, "alpha-live", llama_world.requests["alpha"].lora_path)
    assert response.status_code == 200, response.text
    assert response.text == "Success: LoRA adapter 'alpha-live' added successfully."
    cards = {c["id"]: c for c in client.get("/v1/models").json()["data"]}
    assert cards["alpha-live"]["parent"] == "base"
    assert cards["alpha-live"]["root"] == llama_world.requests["alpha"].lora_path
    # equal to transformers + peft, which the statically loaded adapter gives too
    assert greedy_tokens(client, "alpha-live") == expected_tokens(client, llama_world, "alpha")
    assert greedy_tokens(client, "beta") == expected_tokens(client, llama_world, "beta")
    assert client.post(UNLOAD, json={"lora_name": "alpha-live"}).status_code == 200


def test_an_unloaded_adapter_is_gone_at_once_and_requests_naming_it_get_404(client, llama_world):
    assert load(client, "short-lived", llama_world.requests["alpha"].lora_path).status_code == 200
    lora_id = client.app.state.server.loras["short-lived"].lora_int_id
    response = client.post(UNLOAD, json={"lora_name": "short-lived"})
    assert response.status_code == 200, response.text
    assert "short-lived" not in model_ids(client)
    answer = client.post("/v1/completions", json={"model": "short-lived", **GREEDY})
    assert answer.status_code == 404 and answer.json()["error"]["param"] == "model"
    # no request used it: its weights are freed at once
    assert lora_id not in client.app.state.server.engine.engine.list_loras()


def test_unloading_an_unknown_name_is_a_404_in_openais_shape(client):
    response = client.post(UNLOAD, json={"lora_name": "never-loaded"})
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["type"] == "NotFoundError" and error["param"] == "lora_name"
    assert "'never-loaded' cannot be found" in error["message"]


def test_load_inplace_replaces_the_adapter_of_a_name(client, llama_world):
    assert load(client, "swapped", llama_world.requests["alpha"].lora_path).status_code == 200
    response = load(client, "swapped", llama_world.requests["beta"].lora_path, load_inplace=True)
    assert response.status_code == 200, response.text
    assert greedy_tokens(client, "swapped") == expected_tokens(client, llama_world, "beta")
    assert client.post(UNLOAD, json={"lora_name": "swapped"}).status_code == 200


def _edited_copy(tmp_path, world, **changes) -> str:
    folder = tmp_path / "edited"
    shutil.copytree(world.requests["alpha"].lora_path, folder)
    config_path = folder / "adapter_config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), **changes}))
    return str(folder)


FAILING_LOADS = {
    "missing path": (lambda t, w: str(t / "nowhere"), 404, "lora_path", "no such folder"),
    "not an adapter": (lambda t, w: str(t), 400, "lora_path", "not a PEFT adapter folder"),
    "rank above max_lora_rank": (
        lambda t, w: str(save_peft_adapter(t / "r16", "llama", 5, r=16, target_modules=["q_proj"])),
        400,
        "lora_path",
        "exceeds max_lora_rank=8",
    ),
    "target modules the model lacks": (
        lambda t, w: _edited_copy(t, w, target_modules=["q_proj", "conv_proj"]),
        400,
        "lora_path",
        "['conv_proj'] are not projections of this model",
    ),
    "a name already loaded": (
        lambda t, w: w.requests["alpha"].lora_path,
        400,
        "lora_name",
        "'beta' has already been loaded",
    ),
}


@pytest.mark.parametrize("case", FAILING_LOADS)
def test_a_failing_load_is_a_4xx_naming_the_problem_and_changes_nothing(
    client, llama_world, tmp_path, case
):
    path_of, status, param, message = FAILING_LOADS[case]
    before = served_state(client)
    name = "beta" if case == "a name already loaded" else "candidate"
    response = load(client, name, path_of(tmp_path, llama_world))
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"], error
    assert served_state(client) == before
    assert greedy_tokens(client, "beta") == expected_tokens(client, llama_world, "beta")


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (LOAD, {"lora_name": "x"}, "lora_path"),
        (LOAD, {"lora_name": 7, "lora_path": "/x"}, "lora_name"),
        (LOAD, {"lora_name": "", "lora_path": "/x"}, "lora_name"),
        (LOAD, {"lora_name": "x", "lora_path": "/x", "adapter": "y"}, "adapter"),
        (UNLOAD, {}, "lora_name"),
        (UNLOAD, {"lora_name": "beta", "lora_int_id": 999}, "lora_int_id"),
    ],
)
def test_a_bad_body_is_a_400_naming_the_field(client, path, body, param):
    before = served_state(client)
    response = client.post(path, json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert served_state(client) == before


def test_without_the_opt_in_the_routes_answer_404_naming_the_flag(llama_world, monkeypatch):
    monkeypatch.delenv(ENV_FLAG, raising=False)
    with TestClient(app_for(llama_world, allow=False)) as client:
        for path, body in (
            (LOAD, {"lora_name": "a", "lora_path": "/x"}),
            (UNLOAD, {"lora_name": "a"}),
        ):
            response = client.post(path, json=body)
            assert response.status_code == 404, response.text
            assert "--allow-runtime-lora-updating" in response.json()["error"]["message"]
        assert "/v1/load_lora_adapter" not in client.get("/openapi.json").json()["paths"]


def test_the_env_var_is_an_opt_in_as_vllms(monkeypatch):
    monkeypatch.setenv(ENV_FLAG, "1")
    assert runtime_lora_updating_allowed(False)
    monkeypatch.setenv(ENV_FLAG, "0")
    assert not runtime_lora_updating_allowed(False) and runtime_lora_updating_allowed(True)


def test_without_enable_lora_a_load_is_a_400(llama_world):
    with TestClient(app_for(llama_world, enable_lora=False)) as client:
        response = load(client, "a", llama_world.requests["alpha"].lora_path)
        assert response.status_code == 400
        assert "--enable-lora" in response.json()["error"]["message"]


def test_the_serve_flag_sets_the_option():
    from pagedllm.cli.app import build_parser

    args = build_parser().parse_args(["serve", "--allow-runtime-lora-updating"])
    assert args.allow_runtime_lora_updating
    assert not build_parser().parse_args(["serve"]).allow_runtime_lora_updating


def stream_tokens(client, body: dict, first_token: threading.Event) -> list[str]:
    """The streamed texts of one completion; sets `first_token` on the first."""
    texts = []
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            texts.append(json.loads(line[6:])["choices"][0]["text"])
            first_token.set()
    return texts


def start_stream(
    client, body: dict, first_token: threading.Event, streamed: list
) -> threading.Thread:
    reader = threading.Thread(
        target=lambda: streamed.extend(stream_tokens(client, body, first_token))
    )
    reader.start()
    return reader


def test_a_load_during_a_stream_leaves_the_stream_intact(client, llama_world):
    body = dict(model="beta", prompt=PROMPTS[0], max_tokens=56, temperature=0, ignore_eos=True)
    reference = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    first_token, streamed = threading.Event(), []
    reader = threading.Thread(
        target=lambda: streamed.extend(stream_tokens(client, body, first_token))
    )
    reader.start()
    assert first_token.wait(30)
    response = load(client, "mid-stream", llama_world.requests["alpha"].lora_path)
    loaded_while_streaming = reader.is_alive()
    reader.join(60)
    assert response.status_code == 200, response.text
    assert loaded_while_streaming  # the load did not wait for the stream to end
    assert "".join(streamed) == reference
    assert greedy_tokens(client, "mid-stream") == expected_tokens(client, llama_world, "alpha")
    assert client.post(UNLOAD, json={"lora_name": "mid-stream"}).status_code == 200


def test_an_adapter_unloaded_during_its_stream_serves_it_to_the_end_then_is_freed(
    client, llama_world
):
    assert load(client, "in-use", llama_world.requests["alpha"].lora_path).status_code == 200
    lora_id = client.app.state.server.loras["in-use"].lora_int_id
    body = dict(model="in-use", prompt=PROMPTS[0], max_tokens=56, temperature=0, ignore_eos=True)
    reference = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    first_token, streamed = threading.Event(), []
    reader = threading.Thread(
        target=lambda: streamed.extend(stream_tokens(client, body, first_token))
    )
    reader.start()
    assert first_token.wait(30)
    response = client.post(UNLOAD, json={"lora_name": "in-use"})
    unloaded_while_streaming = reader.is_alive()
    assert response.status_code == 200, response.text
    assert "in-use" not in model_ids(client)  # at once, while its stream still runs
    reader.join(60)
    assert unloaded_while_streaming and "".join(streamed) == reference
    client.post("/v1/completions", json={"model": "beta", **GREEDY})  # one more engine turn
    assert lora_id not in client.app.state.server.engine.engine.list_loras()


def test_a_slow_adapter_read_does_not_stall_other_requests(client, llama_world, monkeypatch):
    manager = client.app.state.server.engine.engine.lora
    reading, release = threading.Event(), threading.Event()
    read = manager.read

    def slow_read(request):
        reading.set()
        assert release.wait(30)
        return read(request)

    monkeypatch.setattr(manager, "read", slow_read)
    answers = []
    loader = threading.Thread(
        target=lambda: answers.append(load(client, "slow", llama_world.requests["alpha"].lora_path))
    )
    loader.start()
    try:
        assert reading.wait(30)
        # the engine keeps serving while the folder is read (a thread, not the engine loop)
        assert greedy_tokens(client, "beta") == expected_tokens(client, llama_world, "beta")
        assert "slow" not in model_ids(client)  # listed only once loaded
    finally:
        release.set()
        loader.join(30)
    assert answers[0].status_code == 200 and "slow" in model_ids(client)
    assert client.post(UNLOAD, json={"lora_name": "slow"}).status_code == 200
