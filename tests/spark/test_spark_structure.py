"""The Spark format shares cgroupd's connection options, consumer names and pyspark floor
(issue 14): one way to reach NATS (TLS included) and one set of names on the server."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("pyspark")

import cgroupd.spark
from cgroupd.core import naming
from cgroupd.core.config import ElasticGroupConfig, PartitioningFilter
from cgroupd.core.errors import ConfigError
from cgroupd.nats import connect
from cgroupd.spark.lease import Claim, Lease, claims_for
from cgroupd.spark.options import SinkOptions, SourceOptions


def test_connection_options_are_cgroupds_own(tmp_path: Path) -> None:
    """TLS files, nkey seeds and the connect timeout reach ConnectionOptions, for the
    source and the sink alike; a lone certificate or two credentials are refused."""
    ca, cert, key, seed = (tmp_path / n for n in ("ca.pem", "c.pem", "c.key", "s.nk"))
    for f in (ca, cert, key, seed):
        f.write_text("x")
    opts = SourceOptions.parse({"stream": "S", "servers": "tls://a:4222,nats://b:4222",
                                "tlsCa": str(ca), "tlsCert": str(cert), "tlsKey": str(key),
                                "nkeySeed": str(seed)})
    conn = opts.connection
    assert isinstance(conn, connect.ConnectionOptions)
    assert (conn.tls_ca, conn.tls_cert, conn.tls_key, conn.nkey_seed) == (ca, cert, key, seed)
    assert conn.uses_tls and conn.server_list == ["tls://a:4222", "nats://b:4222"]
    assert conn.connect_timeout == connect.DEFAULT_CONNECT_TIMEOUT
    sink = SinkOptions.parse({"subject": "x", "tlsCa": str(ca), "connectTimeout": "7"})
    assert sink.connection.tls_ca == ca and sink.connection.connect_timeout == 7
    with pytest.raises(ConfigError) as err:
        SourceOptions.parse({"stream": "S", "tlsCert": str(cert), "token": "t",
                             "nkeySeed": str(seed), "tlsCa": str(tmp_path / "missing")})
    for part in ("tlsCert and tlsKey", "one of creds, token, nkeySeed",
                 "tlsCa file", "does not exist"):
        assert part in str(err.value), part


def test_lease_consumers_use_the_runtimes_names_and_config() -> None:
    """The query's election consumers are named and configured as a member instance's
    (naming.sync_consumer, naming.consumer_config), marked with naming.HOLDER_KEY."""
    config = ElasticGroupConfig(max_members=4, members=("m1", "m2"),
                                partitioning_filters=(PartitioningFilter("o.*", (1,)),))
    claims = claims_for(config, (0, 3), "g")
    assert [c.consumer for c in claims] == [naming.sync_consumer("g", "m1", False),
                                            naming.sync_consumer("g", "m2", False)]
    lease = Lease(None, "O-g", claims, presence_key="O.g")  # type: ignore[arg-type]
    made = lease._config(Claim("m1", "m1", (0, 1)))
    base = naming.consumer_config(["sync.0.>", "sync.1.>"], ack_wait=30.0,
                                  max_ack_pending=1, metadata=made["metadata"])
    assert {k: v for k, v in made.items() if k != "inactive_threshold"} == base
    assert made["metadata"][naming.HOLDER_KEY] == "spark"
    assert made["metadata"][naming.INSTANCE_KEY] == lease.lease_id


def test_register_refuses_a_pyspark_older_than_the_extra(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """pyproject's spark extra and cgroupd.spark agree on the oldest pyspark."""
    import pyspark

    text = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    floor = ".".join(map(str, cgroupd.spark.PYSPARK_MIN))
    assert f'"pyspark>={floor},<5"' in text
    monkeypatch.setattr(pyspark, "__version__", "4.2.1")
    with pytest.raises(ImportError, match=f"pyspark >= {floor} \\(found 4.2.1\\)"):
        cgroupd.spark.register(object())
