"""A `--runner pooling` server: /v1/embeddings through the official `openai` client (float and
base64, a batch, token ids, dimensions), /v1/score and /v1/rerank through httpx, each equal to
transformers; and the 400s (naming the field) for what a client gets wrong."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest
from openai import BadRequestError, OpenAI
from pooling.checkpoints import (
    cosine,
    reference_embedding,
    reference_score,
    save_embedding_checkpoint,
    save_reranker_checkpoint,
)

from pagedllm.pooling.offline import pair_token_ids

from server_util import live_server

TEXTS = ["hello world", "the quick brown fox", "paged attention"]


@pytest.fixture(scope="module")
def embed_model(tmp_path_factory):
    return save_embedding_checkpoint(tmp_path_factory.mktemp("embed"), matryoshka=True)


@pytest.fixture(scope="module")
def embed_server(embed_model):
    with live_server({"model": str(embed_model), "runner": "pooling"}, served_model_name="e") as s:
        yield s


@pytest.fixture(scope="module")
def rerank_model(tmp_path_factory):
    return save_reranker_checkpoint(tmp_path_factory.mktemp("rerank"))


@pytest.fixture(scope="module")
def rerank_server(rerank_model):
    with live_server({"model": str(rerank_model), "runner": "pooling"}, served_model_name="r") as s:
        yield s


@pytest.fixture(scope="module")
def openai_client(embed_server):
    return OpenAI(base_url=f"{embed_server.url}/v1", api_key="unused", max_retries=0, timeout=30)


def encode(server, text: str) -> list[int]:
    return server.engine.tokenizer.encode(text)


def assert_bad_request(response: httpx.Response, param: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error


def test_embeddings_create_gives_transformers_embeddings(openai_client, embed_server, embed_model):
    out = openai_client.embeddings.create(model="e", input=TEXTS[0], encoding_format="float")
    ids = encode(embed_server, TEXTS[0])
    assert cosine(out.data[0].embedding, reference_embedding(embed_model, ids)) >= 0.9999
    assert out.usage.prompt_tokens == out.usage.total_tokens == len(ids)
    assert out.model == "e" and out.data[0].index == 0


def test_base64_embeddings_decode_to_the_float_values(openai_client):
    floats = openai_client.embeddings.create(model="e", input=TEXTS[1], encoding_format="float")
    raw = openai_client.embeddings.create(model="e", input=TEXTS[1], encoding_format="base64")
    decoded = np.frombuffer(base64.b64decode(raw.data[0].embedding), dtype="<f4")
    assert decoded.tolist() == pytest.approx(floats.data[0].embedding, abs=0)
    # the client's default asks for base64 and decodes it itself
    default = openai_client.embeddings.create(model="e", input=TEXTS[1])
    assert default.data[0].embedding == pytest.approx(floats.data[0].embedding, abs=0)


def test_a_batch_is_embedded_in_order(openai_client, embed_server, embed_model):
    out = openai_client.embeddings.create(model="e", input=TEXTS, encoding_format="float")
    assert [d.index for d in out.data] == [0, 1, 2]
    for item, text in zip(out.data, TEXTS):
        expected = reference_embedding(embed_model, encode(embed_server, text))
        assert cosine(item.embedding, expected) >= 0.9999
    assert out.usage.prompt_tokens == sum(len(encode(embed_server, t)) for t in TEXTS)


def test_token_id_inputs_are_embedded_as_given(openai_client, embed_model):
    one = openai_client.embeddings.create(model="e", input=[5, 6, 7], encoding_format="float")
    assert cosine(one.data[0].embedding, reference_embedding(embed_model, [5, 6, 7])) >= 0.9999
    many = openai_client.embeddings.create(
        model="e", input=[[5, 6, 7], [9, 10]], encoding_format="float"
    )
    assert cosine(many.data[1].embedding, reference_embedding(embed_model, [9, 10])) >= 0.9999
    assert many.usage.prompt_tokens == 5


def test_dimensions_cut_a_matryoshka_embedding(openai_client, embed_model):
    out = openai_client.embeddings.create(
        model="e", input=[5, 6, 7], dimensions=16, encoding_format="float"
    )
    assert len(out.data[0].embedding) == 16
    full = reference_embedding(embed_model, [5, 6, 7])
    assert cosine(out.data[0].embedding, full[:16]) >= 0.9999


def test_score_gives_the_sigmoid_of_transformers_logit(rerank_server, rerank_model):
    tokenizer = rerank_server.engine.tokenizer
    body = {"model": "r", "text_1": "a fox", "text_2": TEXTS}
    out = httpx.post(f"{rerank_server.url}/v1/score", json=body, timeout=30).json()
    assert [d["index"] for d in out["data"]] == [0, 1, 2]
    for item, text in zip(out["data"], TEXTS):
        expected = reference_score(rerank_model, pair_token_ids(tokenizer, "a fox", text))
        assert item["score"] == pytest.approx(expected, abs=1e-5)
    aliased = {"model": "r", "queries": "a fox", "documents": TEXTS}
    again = httpx.post(f"{rerank_server.url}/v1/score", json=aliased, timeout=30).json()
    assert [d["score"] for d in again["data"]] == [d["score"] for d in out["data"]]


def test_rerank_sorts_by_relevance_and_keeps_top_n(rerank_server, rerank_model):
    tokenizer = rerank_server.engine.tokenizer
    body = {"model": "r", "query": "a fox", "documents": TEXTS, "top_n": 2}
    out = httpx.post(f"{rerank_server.url}/v1/rerank", json=body, timeout=30).json()
    expected = [reference_score(rerank_model, pair_token_ids(tokenizer, "a fox", t)) for t in TEXTS]
    order = sorted(range(3), key=lambda i: -expected[i])[:2]
    assert [r["index"] for r in out["results"]] == order
    for result in out["results"]:
        assert result["relevance_score"] == pytest.approx(expected[result["index"]], abs=1e-5)
        assert result["document"]["text"] == TEXTS[result["index"]]
    assert out["usage"]["total_tokens"] > 0


@pytest.mark.parametrize("documents", [None, []])
def test_a_rerank_without_documents_is_a_400_naming_documents(rerank_server, documents):
    body = {"model": "r", "query": "a fox"}
    if documents is not None:
        body["documents"] = documents
    assert_bad_request(httpx.post(f"{rerank_server.url}/v1/rerank", json=body), "documents")


def test_an_input_over_max_model_len_is_a_400_naming_input(embed_server):
    body = {"model": "e", "input": [5] * 200}
    assert_bad_request(httpx.post(f"{embed_server.url}/v1/embeddings", json=body), "input")


def test_a_bad_encoding_format_is_a_400_naming_it(embed_server):
    body = {"model": "e", "input": "hi", "encoding_format": "int8"}
    response = httpx.post(f"{embed_server.url}/v1/embeddings", json=body)
    assert_bad_request(response, "encoding_format")


def test_embeddings_from_a_classifier_are_a_400_naming_model(rerank_server):
    body = {"model": "r", "input": "hi"}
    assert_bad_request(httpx.post(f"{rerank_server.url}/v1/embeddings", json=body), "model")


def test_generating_on_a_pooling_server_is_a_400_naming_model(openai_client, embed_server):
    with pytest.raises(BadRequestError) as caught:
        openai_client.completions.create(model="e", prompt="hi", max_tokens=2)
    assert caught.value.body["param"] == "model"
    for path in ("/v1/chat/completions", "/v1/responses"):
        body = {"model": "e", "input": "hi", "messages": [{"role": "user", "content": "hi"}]}
        assert_bad_request(httpx.post(f"{embed_server.url}{path}", json=body), "model")


def test_embeddings_on_a_generating_server_are_a_400_naming_model():
    with live_server() as server:
        body = {"model": "pagedllm/tiny-random", "input": "hi"}
        assert_bad_request(httpx.post(f"{server.url}/v1/embeddings", json=body), "model")
        response = httpx.post(f"{server.url}/v1/rerank", json={"query": "q", "documents": ["d"]})
        assert_bad_request(response, "model")


def test_a_lone_surrogate_is_a_400_naming_input(embed_server):
    body = '{"model": "e", "input": "\\ud800"}'
    response = httpx.post(
        f"{embed_server.url}/v1/embeddings",
        content=body,
        headers={"content-type": "application/json"},
    )
    assert_bad_request(response, "input")


@pytest.mark.parametrize("which", ["embed_server", "rerank_server"])
def test_no_generated_pooling_input_gets_a_server_error(request, which):
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    server = request.getfixturevalue(which)
    api = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    paths = {"/v1/embeddings", "/v1/score", "/v1/rerank"}
    operations = [r.ok() for r in api.get_all_operations() if r.ok().path in paths]
    assert {op.path for op in operations} == paths

    @given(case=st.one_of([op.as_strategy() for op in operations]))
    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
    def fuzz(case):
        response = case.call(base_url=server.url, timeout=30)
        assert response.status_code < 500, (case.path, case.body, response.text)

    fuzz()
    server.wait_idle()
