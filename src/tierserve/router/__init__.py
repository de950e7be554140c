"""Above the engines: how requests reach engine instances (today: the dedicated deployment)."""
