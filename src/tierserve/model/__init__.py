"""Llama-family decoder over a paged KV cache, its loaders, shapes and tokenizer."""
