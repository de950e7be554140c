"""LLMEngine (the step loop), AsyncEngine (asyncio streams), calibration, detokenizer."""
