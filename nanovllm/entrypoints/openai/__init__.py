"""The OpenAI-compatible HTTP server (`nanovllm serve`): see api_server.py."""
