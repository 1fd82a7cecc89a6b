"""Test helpers shared by every kind of test: real nats-server processes, member fleets and
their checkers, the fake adapter, child processes, the interop peer, Spark, Kubernetes and
Prometheus tooling, and the handler modules that `cgroupd join` children load."""
