"""Chat: what the server's `/v1/chat/completions` and `LLM.chat` share, below both (so the
offline API never imports the server).

- `template`: chat-message rendering (the tokenizer's chat template, `--chat-template FILE`, or
  `DEFAULT_CHAT_TEMPLATE`) and its tokenization
- `tools`: a request's tools, tool choice and reasoning planned into a constraint and a reply
  splitter (`ChatOptions`, `plan_chat`)
- `tool_parsers`: a reply's tool calls, whole or streamed (hermes, llama3_json)
- `reasoning_parsers`: a reply's thinking split from its answer (qwen3, deepseek_r1)
"""
