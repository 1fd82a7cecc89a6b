"""Handler modules that ``cgroupd join`` subprocesses load in tests."""
