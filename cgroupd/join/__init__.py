"""``cgroupd join``: the daemon around one member instance (its handler, probes,
metrics and what it tells operators)."""
