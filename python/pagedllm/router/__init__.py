"""`pagedllm router`: an OpenAI-compatible proxy in front of data-parallel `pagedllm serve`
replicas that routes each request by the replicas' prefix caches (known exactly from their KV
events) and their load (`app.py`; the replicas' state in `replicas.py`; the decisions are the
Rust core's `Router`)."""
