"""The simulator: the real scheduler, block manager and cost meter, driven by a step-time model and a manual clock (no torch)."""
