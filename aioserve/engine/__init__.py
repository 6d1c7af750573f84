"""The engine: requests, scheduling, the KV block manager, outputs, AsyncEngine and LLM."""
