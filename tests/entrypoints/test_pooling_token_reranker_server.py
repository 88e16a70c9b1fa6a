"""A `--runner pooling --hf-overrides` server over a causal Qwen3 made a Qwen3-Reranker:
/v1/score and /v1/rerank (through httpx) equal transformers' sigmoid of the yes/no log-odds on
the same text, rerank results sorted with `index` and `relevance_score`, a `--chat-template`
rendering each pair, and the 400s naming the field."""

from __future__ import annotations

import httpx
import pytest
from pooling.checkpoints import reference_token_score, token_reranker_overrides

from model_factory import save_tiny_checkpoint
from server_util import live_server

ENGINE = {"runner": "pooling", "max_model_len": 256, "hf_overrides": token_reranker_overrides()}
QUERY = "<Instruct>: Given a query, find the passages that answer it\n<Query>: a fox\n"
DOCUMENTS = ["<Document>: jumps over the lazy dog", "<Document>: blocks", "<Document>: a fox"]
# a score template (vLLM's --chat-template for /v1/score and /v1/rerank): messages query, document
TEMPLATE = (
    "Judge the Document. Answer he or lo.\n<Query>: {{ messages[0]['content'] }}\n"
    "<Document>: {{ messages[1]['content'] }}\nAnswer: "
)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("qwen3-reranker"), "qwen3")


@pytest.fixture(scope="module")
def server(model):
    with live_server({"model": str(model), **ENGINE}, served_model_name="q") as live:
        yield live


def expected_scores(server, model, texts: list[str]) -> list[float]:
    tokenizer = server.engine.tokenizer
    vocab = tokenizer.backend.get_vocab()
    false_id, true_id = (vocab[t] for t in token_reranker_overrides()["classifier_from_token"])
    return [
        reference_token_score(model, tokenizer.encode(text), false_id, true_id) for text in texts
    ]


def test_score_gives_the_sigmoid_of_transformers_token_log_odds(server, model):
    body = {"model": "q", "text_1": QUERY, "text_2": DOCUMENTS}
    response = httpx.post(f"{server.url}/v1/score", json=body, timeout=60)
    assert response.status_code == 200, response.text
    out = response.json()
    assert [d["index"] for d in out["data"]] == [0, 1, 2]
    expected = expected_scores(server, model, [QUERY + d for d in DOCUMENTS])
    assert [d["score"] for d in out["data"]] == pytest.approx(expected, rel=1e-5, abs=1e-6)


def test_rerank_sorts_by_relevance_with_index_and_relevance_score(server, model):
    body = {"model": "q", "query": QUERY, "documents": DOCUMENTS, "top_n": 2}
    response = httpx.post(f"{server.url}/v1/rerank", json=body, timeout=60)
    assert response.status_code == 200, response.text
    results = response.json()["results"]
    texts = [QUERY + d for d in DOCUMENTS]
    expected = expected_scores(server, model, texts)
    tokens = sum(len(server.engine.tokenizer.encode(text)) for text in texts)
    assert response.json()["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    order = sorted(range(len(DOCUMENTS)), key=lambda i: -expected[i])[:2]
    assert [r["index"] for r in results] == order
    for result in results:
        assert result["relevance_score"] == pytest.approx(expected[result["index"]], rel=1e-5)
        assert result["document"]["text"] == DOCUMENTS[result["index"]]


def test_the_instruction_is_served_from_the_prefix_cache(server):
    def rerank(document: str) -> None:
        body = {"model": "q", "query": QUERY, "documents": [document]}
        assert httpx.post(f"{server.url}/v1/rerank", json=body, timeout=60).status_code == 200
        server.wait_idle()

    rerank("<Document>: a dog runs")
    hits = server.metric("pagedllm:prefix_cache_hits_total")
    rerank("<Document>: a cat sleeps")
    shared = len(server.engine.tokenizer.encode(QUERY)) - 1  # the query's last token may merge
    assert server.metric("pagedllm:prefix_cache_hits_total") - hits == shared // 16


def test_a_chat_template_renders_each_pair(model):
    with live_server(
        {"model": str(model), **ENGINE}, served_model_name="q", chat_template=TEMPLATE
    ) as live:
        body = {"model": "q", "query": "a fox", "documents": ["jumps", "sleeps"]}
        response = httpx.post(f"{live.url}/v1/rerank", json=body, timeout=60)
        assert response.status_code == 200, response.text
        texts = [
            f"Judge the Document. Answer he or lo.\n<Query>: a fox\n<Document>: {d}\nAnswer: "
            for d in ("jumps", "sleeps")
        ]
        expected = expected_scores(live, model, texts)
        got = {r["index"]: r["relevance_score"] for r in response.json()["results"]}
        assert [got[0], got[1]] == pytest.approx(expected, rel=1e-5, abs=1e-6)


def test_more_queries_than_documents_is_a_400_naming_text_2(server):
    body = {"model": "q", "text_1": [QUERY, QUERY], "text_2": DOCUMENTS}
    response = httpx.post(f"{server.url}/v1/score", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "text_2"


def test_a_pair_over_max_model_len_is_a_400_naming_documents(server):
    body = {"model": "q", "query": QUERY, "documents": ["<Document>: " + "fox " * 300]}
    response = httpx.post(f"{server.url}/v1/rerank", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "documents"
