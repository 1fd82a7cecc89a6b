"""Fault-injection suite: every guarantee of cgroupd attacked, with invariants checked.

Harness modules: :mod:`.runner` (``cgroupd join`` processes), :mod:`.recorder` (recording
handlers writing to SQLite), :mod:`.traffic` (keyed publisher), :mod:`.injectors`
(signals, server restarts, cluster faults, network namespaces), :mod:`.checks` (views,
checkers, the table), :mod:`.scenario` (one scenario end to end). Scenarios are the
``test_*.py`` modules; run them with ``pytest -m faults tests/faults``.
"""
