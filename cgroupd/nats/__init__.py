"""The NATS adapter: the only package that imports nats-py or builds ``$JS.API``
requests. The runtime reaches JetStream through :class:`cgroupd.nats.adapter.JetStreamPort`.

:mod:`~cgroupd.nats.natsload` runs first, here, so that whichever adapter module is
imported first, nats-py loads without aiohttp (see there).
"""

from cgroupd.nats import natsload  # noqa: F401 - before any module of ours imports nats-py
