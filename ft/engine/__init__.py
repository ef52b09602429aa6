"""The engine: model runner (one per rank), executors that run ranks, and the engine loop."""
