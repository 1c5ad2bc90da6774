"""Telling a broker that refuses us apart from an absent one (design §12): connect as
each client does, authenticate, and on a refusal raise `KafkaAccessError` naming the cause
(authentication or TLS) and the `STOVEPIPE_KAFKA_*` variables to check, at once — where
the clients themselves would only say "Unable to bootstrap" or "timed out" after their
whole timeout. How the clients connect is `streams.config.kafka_security`."""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from typing import Any

from aiokafka.errors import (
    AuthenticationFailedError,
    AuthenticationMethodNotSupported,
    IllegalSaslStateError,
    KafkaConnectionError,
    SaslAuthenticationFailed,
    UnsupportedSaslMechanismError,
)

from streams.config.kafka_security import (
    ENV_SASL_MECHANISM,
    ENV_SECURITY_PROTOCOL,
    ENV_SSL_CA_LOCATION,
    ENV_SSL_CERTIFICATE_LOCATION,
    ENV_SSL_ENDPOINT_IDENTIFICATION,
    ENV_SSL_KEY_LOCATION,
    KafkaAccessError,
    KafkaSecurity,
    OidcTokenError,
    bootstrap_list,
    librdkafka_conf,
)

AUTHENTICATION, TLS = "authentication", "tls"  # the two kinds of refusal


def explain_refusal(kind: str, reason: str, bootstrap: str, security: KafkaSecurity) -> str:
    """One line naming what to fix after the broker at `bootstrap` refused us: `kind` is
    AUTHENTICATION or TLS, `reason` the client's own words."""
    if kind == AUTHENTICATION:
        return (f"Kafka at {bootstrap} refused authentication as {security.who()} "
                f"({reason}): check {security.credential_variables()} and "
                f"{ENV_SASL_MECHANISM}")
    lowered = reason.lower()
    hint = f"{ENV_SSL_CA_LOCATION} (the CA that signed the broker's certificate)"
    if "hostname" in lowered or "ip address mismatch" in lowered:
        hint = (f"the bootstrap host against the names in the broker's certificate (or "
                f"{ENV_SSL_ENDPOINT_IDENTIFICATION}=none)")
    elif "verify failed" not in lowered:
        hint = (f"{ENV_SSL_CERTIFICATE_LOCATION} and {ENV_SSL_KEY_LOCATION} (a broker that "
                f"requires a client certificate closes the connection without one it trusts), "
                f"{ENV_SSL_CA_LOCATION}")
    return (f"TLS with Kafka at {bootstrap} failed ({reason}): check {hint}, and that the "
            f"port speaks {ENV_SECURITY_PROTOCOL}={security.protocol}")


async def check_aiokafka_access(bootstrap: str, security: KafkaSecurity | None = None, *,
                                connect_within: float = 5.0) -> None:
    """Connect to the bootstrap servers as aiokafka does and authenticate; return at the
    first that accepts us. `KafkaAccessError` when one refused us (authentication, TLS),
    aiokafka's KafkaConnectionError (as its clients raise) when none answered within
    `connect_within` seconds each.
    aiokafka itself folds every such failure into "Unable to bootstrap": this names the
    cause."""
    from aiokafka.conn import create_conn
    from aiokafka.errors import KafkaError

    security = security or KafkaSecurity.from_env()
    settings = security.aiokafka()
    failure: BaseException | None = None
    refusal: str | None = None
    for server in bootstrap_list(bootstrap):
        host, _, port = server.rpartition(":")
        try:
            async with asyncio.timeout(connect_within):
                conn = await create_conn(host.strip("[]") or server, int(port or 9092),
                                         request_timeout_ms=int(connect_within * 1000),
                                         **settings)
        except (KafkaError, OSError, TimeoutError) as exc:
            failure = exc
            kind = _aiokafka_refusal(exc, security)
            if kind is not None and refusal is None:
                refusal = explain_refusal(kind, _aiokafka_reason(exc), server, security)
            continue
        conn.close()
        return
    if refusal is not None:
        raise KafkaAccessError(refusal)
    reason = _aiokafka_reason(failure) if failure is not None else "no bootstrap server"
    if isinstance(failure, TimeoutError):
        reason = f"no answer within {connect_within:g}s"
    raise KafkaConnectionError(f"cannot connect to {bootstrap}: {reason}")


def _aiokafka_refusal(exc: BaseException, security: KafkaSecurity) -> str | None:
    """AUTHENTICATION or TLS when aiokafka's `exc` says the broker refused us, else None."""
    if isinstance(exc, ssl.SSLError):
        return TLS
    if isinstance(exc, OidcTokenError | AuthenticationFailedError | SaslAuthenticationFailed
                  | UnsupportedSaslMechanismError | IllegalSaslStateError
                  | AuthenticationMethodNotSupported):
        return AUTHENTICATION
    # over TLS 1.3 a broker that rejects our certificate (or its absence) does so after
    # the handshake: aiokafka sees the connection closed
    if (isinstance(exc, KafkaConnectionError) and security.uses_tls
            and "closed" in str(exc).lower()):
        return TLS
    return None


def _aiokafka_reason(exc: BaseException) -> str:
    if isinstance(exc, ssl.SSLError):
        return f"TLS: {exc.reason or exc}".replace("_", " ").lower()
    text = " ".join(str(exc).split())
    return text or type(exc).__name__


def check_librdkafka_access(bootstrap: str, security: KafkaSecurity | None = None, *,
                            timeout: float = 5.0) -> Any:
    """The cluster's metadata, asked for as the confluent-kafka clients ask. librdkafka
    retries a refused authentication or TLS handshake until the caller's timeout and then
    says only "timed out"; this raises `KafkaAccessError` naming the cause as soon as
    librdkafka reports one, and TimeoutError when nothing answers within `timeout`."""
    security = security or KafkaSecurity.from_env()
    metadata, refusal, last = _ask_for_metadata(bootstrap, security, timeout)
    # raised here, where no frame of the traceback holds the client: it is gone already
    if refusal is not None:
        raise KafkaAccessError(explain_refusal(*refusal, bootstrap, security))
    if metadata is None:
        raise TimeoutError(f"no answer within {timeout:g}s ({last})")
    return metadata


def _ask_for_metadata(bootstrap: str, security: KafkaSecurity, timeout: float
                      ) -> tuple[Any, tuple[str, str] | None, str]:
    """(metadata or None, the first refusal (kind, reason) or None, the last error)."""
    from confluent_kafka import KafkaError, KafkaException
    from confluent_kafka.admin import AdminClient

    refused: list[tuple[str, str]] = []

    def on_error(err: Any) -> None:
        text = err.str()
        if err.code() == KafkaError._AUTHENTICATION:
            refused.append((AUTHENTICATION, text))
        # a failed handshake or a TLS alert comes as a transport error
        elif err.code() == KafkaError._SSL or (err.code() == KafkaError._TRANSPORT
                                               and "ssl" in text.lower()):
            refused.append((TLS, text))

    admin = AdminClient(librdkafka_conf(bootstrap, security, error_cb=on_error,
                                        logger=_LIBRDKAFKA_LOG))
    deadline = time.monotonic() + timeout
    last = "no answer"
    while True:
        try:
            return admin.list_topics(
                timeout=max(0.05, min(0.25, deadline - time.monotonic()))), None, last
        except KafkaException as exc:
            err = exc.args[0] if exc.args else exc
            last = err.str() if isinstance(err, KafkaError) else str(err)
        admin.poll(0)  # serves error_cb
        if refused:
            return None, refused[0], last
        if time.monotonic() >= deadline:
            return None, None, last


# librdkafka logs each failed connection; the access check reports them in one line instead
_LIBRDKAFKA_LOG = logging.getLogger("stovepipe.kafka.access")
_LIBRDKAFKA_LOG.addHandler(logging.NullHandler())
_LIBRDKAFKA_LOG.propagate = False
