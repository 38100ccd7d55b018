"""The OpenAI request path: request shapes, a request prepared into prompts (chat template, structured outputs, tools, reasoning), and its deltas built back into responses or SSE."""
