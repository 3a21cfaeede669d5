"""``reader serve``: an OpenAI-compatible HTTP server with continuous batching (the ``serve`` extra)."""
