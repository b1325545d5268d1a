"""MoE LLM inference: models, loaders, the paged-KV engine and the OpenAI/Anthropic-compatible server."""
