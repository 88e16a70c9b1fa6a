"""Online serving: an OpenAI-compatible HTTP server over `LLMEngine`.

Chat rendering, tool calls and reasoning come from `pagedllm.chat` (shared with `LLM.chat`).

- `async_engine.py`: `AsyncEngine`, one background task that owns the engine and steps it in a
  worker thread; each request gets an asyncio queue of its outputs.
- `api_server.py`: the FastAPI app (`/v1/completions`, `/v1/chat/completions`, `/v1/models`,
  `/health`, `/metrics`) and `run_server` behind `pagedllm serve`.
"""
