"""Every error cgroupd raises, as one tree.

    CgroupdError                      base; ``retriable`` says whether trying again can help
    ├── ConfigError                   a group config, KV record or name breaks a rule
    ├── GroupNotFound                 no KV record for <stream>.<group>
    ├── GroupExists                   create asked for a config that differs from the stored one
    ├── StreamNotFound                a stream the operation needs does not exist
    ├── BucketNotFound                the consumer-group KV bucket does not exist
    ├── JetStreamNotEnabled           the server (or account) has no JetStream
    ├── PermissionDenied              the server refused the operation for these credentials
    ├── ServerUnreachable             no server answered (retriable)
    ├── ConflictError                 a CAS update lost too many races (retriable)
    ├── ApiError                      any other ``$JS.API`` error: status code and err_code
    │   ├── ConsumerNotFound          no consumer of that name (10014)
    │   ├── ConsumerExists            create-only, and a differing consumer exists (10148)
    │   ├── WorkQueueOverlap          a work-queue consumer's filters overlap another's (10100)
    │   └── DirectGetUnavailable      the stream does not answer direct gets
    ├── AckNotConfirmed               ``double_ack``: the server did not apply the ack
    │   └── AckOutcomeUnknown         ``double_ack``: applied or not, nobody can tell
    ├── InstanceIdInUse               another running process already uses this instance id
    ├── LeaseUnavailable              a Spark query cannot hold a member another holder has
    ├── LeaseLost                     a running Spark query lost a member it reads
    ├── DataLoss                      messages a Spark query had to read are gone
    └── ReplicaBehind                 no replica served a range to its end (retriable)

Lower-level errors (nats-py exceptions) are translated at the JetStream adapter boundary
with ``raise ... from``; nothing above the adapter sees a nats-py exception.
"""

from __future__ import annotations


class CgroupdError(Exception):
    """Base of every cgroupd error."""

    retriable: bool = False


class ConfigError(CgroupdError, ValueError):
    """A group config, KV record or name breaks a rule; ``problems`` lists the rules broken.

    A hostile record can break thousands of rules with megabyte-long values: at most
    ``MAX_PROBLEMS`` problems of at most ``MAX_PROBLEM_LENGTH`` characters are kept, so
    the message stays readable and a log line stays small.
    """

    MAX_PROBLEMS = 20
    MAX_PROBLEM_LENGTH = 300

    def __init__(self, problems: list[str] | str) -> None:
        given = [problems] if isinstance(problems, str) else list(problems)
        cut = self.MAX_PROBLEM_LENGTH
        kept = [p if len(p) <= cut else p[:cut - 1] + "…" for p in given[:self.MAX_PROBLEMS]]
        if len(given) > self.MAX_PROBLEMS:
            kept.append(f"and {len(given) - self.MAX_PROBLEMS} more problems")
        self.problems = kept
        super().__init__("; ".join(self.problems))


class GroupNotFound(CgroupdError):
    """No consumer group record exists for this stream and group."""


class GroupExists(CgroupdError):
    """A group of this name exists with a different configuration."""


class StreamNotFound(CgroupdError):
    """A stream the operation needs does not exist."""


class BucketNotFound(CgroupdError):
    """The consumer-group KV bucket does not exist (no group was ever created here)."""


class JetStreamNotEnabled(CgroupdError):
    """The server, or this account, does not have JetStream enabled."""


class PermissionDenied(CgroupdError):
    """The server refused the operation for these credentials."""


class ServerUnreachable(CgroupdError):
    """No NATS server answered in time."""

    retriable = True


class ConflictError(CgroupdError):
    """An optimistic (CAS) update kept losing to concurrent writers."""

    retriable = True


class ApiError(CgroupdError):
    """A ``$JS.API`` request failed; ``code`` is the status, ``err_code`` JetStream's own code."""

    def __init__(self, code: int, err_code: int, description: str) -> None:
        self.code = code
        self.err_code = err_code
        self.description = description
        super().__init__(f"{description} (status {code}, err_code {err_code})")

    @property
    def retriable(self) -> bool:  # type: ignore[override]
        """Server-side timeouts and unavailability can pass; bad requests do not."""
        return self.code in (408, 503) or self.code >= 500


class ConsumerNotFound(ApiError):
    """The consumer does not exist (err_code 10014)."""


class ConsumerExists(ApiError):
    """``action: create`` found a consumer of that name with a different configuration
    (err_code 10148): another instance holds it."""


class WorkQueueOverlap(ApiError):
    """A work-queue stream's consumer filters must not overlap (err_code 10100): another
    consumer still holds some of these partitions."""


class DirectGetUnavailable(ApiError):
    """The stream does not answer direct gets (``allow_direct`` is off)."""


class AckNotConfirmed(CgroupdError):
    """The server did not apply the ack: this instance no longer owns the message (its
    data consumer is gone), and the message goes, or went, to the member's next owner.
    Roll back the message's side effects."""


class AckOutcomeUnknown(AckNotConfirmed):
    """The ack was sent but its outcome cannot be known: no reply came (a reconnect, a
    partition, a server restart), and by the time cgroupd could look, the message was no
    longer in the group's work-queue stream, which is what both an applied ack and a
    successor's processing look like. Treat the message as *in doubt*: keep what the
    handler prepared and resolve it by the message's stream sequence (was it committed by
    another instance?), as a transaction manager resolves an in-doubt transaction. Catching
    :class:`AckNotConfirmed` alone treats it as not applied (rolled back), which can lose
    the message when the ack had in fact been applied. In pinned mode it is also raised
    when the confirmation came after this instance could no longer prove it held the pin."""


class InstanceIdInUse(CgroupdError):
    """Another running process answers for this instance id: two processes with one id
    would both pass for the member's active instance."""


class LeaseUnavailable(CgroupdError):
    """Another holder (a daemon instance or another query) has a member the query needs."""

    retriable = True


class LeaseLost(CgroupdError):
    """The query no longer holds a member it is reading: the query must stop."""


class DataLoss(CgroupdError):
    """Messages a Spark query had to read are gone (a stream recreated, messages removed
    before they were read), or its checkpoint belongs to another stream."""


class ReplicaBehind(CgroupdError):
    """Direct gets kept ending before a range's end although the stream leader holds more:
    the replicas that answer are behind (or the leader's answer could not be had)."""

    retriable = True
