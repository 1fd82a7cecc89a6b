"""nats-py's exceptions, translated at the adapter boundary into cgroupd's error tree
(:mod:`cgroupd.core.errors`), so nothing above the adapter sees a nats-py exception.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import nats.errors
import nats.js.errors

from cgroupd.core.errors import (
    ApiError,
    BucketNotFound,
    CgroupdError,
    ConflictError,
    JetStreamNotEnabled,
    NoAnswer,
    PermissionDenied,
    ServerUnreachable,
    StreamNotFound,
)
from cgroupd.nats import jsapi


@contextlib.contextmanager
def translated(what: str) -> Iterator[None]:
    """Re-raise nats-py errors raised while doing ``what`` as cgroupd errors."""
    try:
        yield
    except (CgroupdError, nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError,
            nats.js.errors.NoKeysError):
        raise  # already ours, or absence that the caller turns into a value
    except nats.js.errors.NoStreamResponseError as exc:
        # A JetStream publish that no stream stored (or none answered yet: a stream in
        # a cluster still placing itself). Worth retrying; wrong config if it persists.
        raise ApiError(503, 0, f"{what}: no stream stored it (does a stream capture "
                               "this subject?)") from exc
    except nats.js.errors.BucketNotFoundError as exc:
        raise BucketNotFound(f"{what}: the consumer group KV bucket does not exist") from exc
    except nats.js.errors.KeyWrongLastSequenceError as exc:
        raise ConflictError(f"{what}: the record changed concurrently") from exc
    except nats.js.errors.APIError as exc:
        code = int(exc.code or 500)
        err_code = int(exc.err_code or 0)
        desc = exc.description or str(exc)
        if isinstance(exc, nats.js.errors.ServiceUnavailableError) and exc.code is None:
            # nats-py's translation of "no responders" on a $JS.API subject.
            raise JetStreamNotEnabled(
                f"{what}: no JetStream answered (is JetStream enabled for this account?)"
            ) from exc
        if err_code == jsapi.ERR_JS_NOT_ENABLED:
            raise JetStreamNotEnabled(f"{what}: {desc}") from exc
        if err_code == jsapi.ERR_STREAM_NOT_FOUND:
            raise StreamNotFound(f"{what}: stream not found") from exc
        if code == 403 or "permission" in desc.lower():
            raise PermissionDenied(f"{what}: permission denied ({desc})") from exc
        raise ApiError(code, err_code, f"{what}: {desc}") from exc
    except nats.errors.NoRespondersError as exc:
        raise JetStreamNotEnabled(
            f"{what}: no JetStream answered (is JetStream enabled for this account?)"
        ) from exc
    except (TimeoutError, nats.errors.TimeoutError) as exc:
        raise NoAnswer(f"{what}: the server did not answer in time") from exc
    except (nats.errors.ConnectionClosedError, nats.errors.ConnectionReconnectingError,
            nats.errors.StaleConnectionError) as exc:
        raise ServerUnreachable(f"{what}: not connected to NATS") from exc
