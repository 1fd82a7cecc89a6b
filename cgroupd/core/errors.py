"""Every error cgroupd raises, as one tree of families: catch a family to handle every
error of its kind, or one error for one case.

    CgroupdError                      base; ``retriable`` says whether trying again can help
    ├── ConfigError                   bad settings, group config, KV record, name or argument
    │   ├── HandlerLoadError          a ``pkg.module:function`` handler cannot be loaded
    │   └── BadRecord                 a stored group record cannot be read (not a usage error)
    ├── NotFoundError                 something the operation needs does not exist
    │   ├── GroupNotFound             no KV record for <stream>.<group>
    │   ├── StreamNotFound            a stream the operation needs does not exist
    │   ├── BucketNotFound            the consumer-group KV bucket does not exist
    │   └── ConsumerNotFound          no consumer of that name (also an ApiError, 10014)
    ├── StateConflict                 what exists, or another holder, disagrees with the request
    │   ├── GroupExists               create asked for a config that differs from the stored one
    │   ├── ConflictError             a CAS update lost too many races (retriable)
    │   ├── ConsumerExists            create-only, a differing consumer exists (ApiError, 10148)
    │   ├── WorkQueueOverlap          filters overlap another consumer's (ApiError, 10100)
    │   ├── InstanceIdInUse           another running process already uses this instance id
    │   ├── LeaseUnavailable          a Spark query cannot hold a member another holder has
    │   └── ReplayRefused             a replay cannot be done safely now
    ├── ServerError                   the server, or the way to it, failed or refused
    │   ├── JetStreamNotEnabled       the server (or account) has no JetStream
    │   ├── PermissionDenied          the server refused the operation for these credentials
    │   ├── ServerUnreachable         no server answered (retriable)
    │   │   ├── ServerBusy            a server was reached but did not let us in in time
    │   │   └── NoAnswer              connected and asked, but no answer came in time
    │   └── ApiError                  any other ``$JS.API`` error: status code and err_code
    │       └── DirectGetUnavailable  the stream does not answer direct gets
    ├── AckNotConfirmed               ``double_ack``: the server did not apply the ack
    │   └── AckOutcomeUnknown         ``double_ack``: applied or not, nobody can tell
    ├── HandlerError                  a handler failed in a way the runtime reports as such
    │   ├── HandlerRaised             a sync handler raised a BaseException (SystemExit & co.)
    │   ├── HandlerReturnedGenerator  a handler returned a generator: its body never ran
    │   ├── NonRetryable              raised by a handler: never retry, dead-letter and term
    │   ├── WebhookFailed             the webhook did not accept the message this time
    │   └── DeadLetterFailed          the dead-letter publish failed: the message is kept
    ├── StartupError                  the daemon could not start
    └── QueryError                    a Spark query cannot go on
        ├── LeaseLost                 a running Spark query lost a member it reads
        ├── DataLoss                  messages a Spark query had to read are gone
        └── ReplicaBehind             no replica served a range to its end (retriable)

Lower-level errors (nats-py exceptions) are translated at the JetStream adapter boundary
with ``raise ... from``; nothing above the adapter sees a nats-py exception.
"""

from __future__ import annotations


class CgroupdError(Exception):
    """Base of every cgroupd error."""

    retriable: bool = False


class NotFoundError(CgroupdError):
    """Something the operation needs (a group, stream, bucket, consumer) does not exist."""


class StateConflict(CgroupdError):
    """What exists, or another holder, disagrees with what was asked."""


class ServerError(CgroupdError):
    """The server, or the way to it, failed or refused the operation."""


class HandlerError(CgroupdError):
    """A handler failed in a way the runtime reports as such (its message is retried,
    dead-lettered or termed, never lost)."""


class QueryError(CgroupdError):
    """A Spark query cannot go on."""


class ConfigError(CgroupdError):
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


class BadRecord(ConfigError):
    """A group's stored KV record cannot be read (garbage, or a shape no version reads).

    A ConfigError, so a running member treats it as any bad record; the CLI exits 1, not
    2: nothing the user typed was wrong. ``group delete --force`` removes such a record.
    """


class GroupNotFound(NotFoundError):
    """No consumer group record exists for this stream and group."""


class GroupExists(StateConflict):
    """A group of this name exists with a different configuration."""


class StreamNotFound(NotFoundError):
    """A stream the operation needs does not exist."""


class BucketNotFound(NotFoundError):
    """The consumer-group KV bucket does not exist (no group was ever created here)."""


class JetStreamNotEnabled(ServerError):
    """The server, or this account, does not have JetStream enabled."""


class PermissionDenied(ServerError):
    """The server refused the operation for these credentials."""


class ServerUnreachable(ServerError):
    """No NATS server answered in time."""

    retriable = True


class ServerBusy(ServerUnreachable):
    """The first connect timed out rather than being refused: a server (or the way to it)
    too busy to finish the handshake in time, as under a mass start. ``cgroupd join``
    retries it; a refused connection (nothing listens there) ends it."""


class NoAnswer(ServerUnreachable):
    """A request was sent on a live connection and its answer did not come in time: an
    overloaded server (its queue longer than the wait), or one out of reach across a
    cluster. The request may still be carried out."""


class ConflictError(StateConflict):
    """An optimistic (CAS) update kept losing to concurrent writers."""

    retriable = True


class ApiError(ServerError):
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

    @property
    def files_lost(self) -> bool:
        """The server could not write a consumer's files because their directory is gone:
        nats-server 2.15.1 removes a deleted consumer's files after announcing the
        deletion, so a consumer of the same name created in between loses them. It says
        so as "no such file or directory", or (when the removal came first) "error
        creating store for consumer" (CI on this wave's merge: an admin step-down's
        standby never took over; tests/unit/test_election_unit.py, both texts)."""
        return self.code >= 500 and ("no such file or directory" in self.description
                                     or "error creating store for consumer"
                                     in self.description)


class ConsumerNotFound(ApiError, NotFoundError):
    """The consumer does not exist (err_code 10014)."""


class ConsumerExists(ApiError, StateConflict):
    """``action: create`` found a consumer of that name with a different configuration
    (err_code 10148): another instance holds it."""


class WorkQueueOverlap(ApiError, StateConflict):
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


class InstanceIdInUse(StateConflict):
    """Another running process answers for this instance id: two processes with one id
    would both pass for the member's active instance."""


class LeaseUnavailable(StateConflict):
    """Another holder (a daemon instance or another query) has a member the query needs."""

    retriable = True


class LeaseLost(QueryError):
    """The query no longer holds a member it is reading: the query must stop."""


class DataLoss(QueryError):
    """Messages a Spark query had to read are gone (a stream recreated, messages removed
    before they were read), or its checkpoint belongs to another stream."""


class ReplicaBehind(QueryError):
    """Direct gets kept ending before a range's end although the stream leader holds more:
    the replicas that answer are behind (or the leader's answer could not be had)."""

    retriable = True


class StreamNotFoundApi(ApiError, StreamNotFound):
    """A stream-not-found API reply: both an ApiError and a StreamNotFound."""


class HandlerLoadError(ConfigError):
    """A ``pkg.module:function`` handler reference cannot be loaded."""


class HandlerRaised(HandlerError):
    """A sync handler raised something that is not an ``Exception`` (SystemExit,
    KeyboardInterrupt, GeneratorExit, another BaseException) in its thread."""

    def __init__(self, original: BaseException) -> None:
        super().__init__(f"the handler raised {original!r}")
        self.original = original


class HandlerReturnedGenerator(HandlerError, TypeError):
    """The handler returned a generator: its body (with a ``yield`` by mistake) never ran."""


class NonRetryable(HandlerError):
    """Raise from a handler when the message can never succeed: it is dead-lettered (if a
    dead-letter subject is set) and termed, never retried."""


class WebhookFailed(HandlerError):
    """The webhook did not accept the message this time; it will be redelivered."""


class DeadLetterFailed(HandlerError):
    """Publishing to the dead-letter subject failed; the message will be redelivered."""


class StartupError(CgroupdError):
    """The daemon could not start (probe port in use, group unreadable in time)."""


class ReplayRefused(StateConflict):
    """The replay cannot be done safely now (instances running, messages in the way)."""
