"""The pure core: group configs, names, partition rules, settings, errors. No I/O,
no nats-py: everything here is a rule that can be tested without a server."""
