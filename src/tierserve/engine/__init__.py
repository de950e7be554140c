"""LLMEngine (the step loop), AsyncEngine (asyncio streams), outputs and stats."""
