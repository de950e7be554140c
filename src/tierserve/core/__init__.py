"""Request state, paged KV block manager, scheduler and clock. Imports no torch."""
