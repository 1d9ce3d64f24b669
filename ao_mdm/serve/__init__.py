"""Serving: the engine thread that owns the model and decodes requests by continuous batching
(`engine.py`) and the OpenAI-compatible HTTP API over it (`api.py`); `ao-mdm serve` runs both."""
