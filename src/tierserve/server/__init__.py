"""OpenAI-compatible HTTP server: create_app(backend, settings)."""
