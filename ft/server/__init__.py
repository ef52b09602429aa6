"""The OpenAI-compatible HTTP server (``ft serve``)."""
