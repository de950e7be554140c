"""OpenAI-compatible HTTP server: create_app(engine, settings)."""
