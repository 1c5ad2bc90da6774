"""The secure listeners of the dev-stack broker (`stovepipe dev up --secure`): their
ports, how a client authenticates on SASL_SSL, and the dev user's SCRAM credentials,
written through the admin API over the PLAINTEXT listener on every secure start (so a
broker formatted before works)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from confluent_kafka import KafkaException
from confluent_kafka.admin import (
    AdminClient,
    ScramCredentialInfo,
    ScramMechanism,
    UserScramCredentialUpsertion,
)

from streams.config.kafka_security import KafkaSecurity, librdkafka_conf

from . import env
from .common import DevStackError
from .tls import KAFKA_USER, DevSecrets

SCRAM_ITERATIONS = 8192
PLAINTEXT = KafkaSecurity()  # the dev broker's own listener, whatever the environment says

# librdkafka logs every refused connection; the admin client here must stay silent.
_SILENT = logging.getLogger("streams.devstack.kafka.secure")
_SILENT.addHandler(logging.NullHandler())
_SILENT.propagate = False


@dataclass(frozen=True)
class SecureListeners:
    """The ports of the secure listeners of a `dev up --secure` broker."""

    sasl_ssl_port: int
    ssl_port: int

    @property
    def sasl_ssl_bootstrap(self) -> str:
        return f"127.0.0.1:{self.sasl_ssl_port}"

    @property
    def ssl_bootstrap(self) -> str:
        return f"127.0.0.1:{self.ssl_port}"

    def describe(self) -> str:
        return (f"SASL_SSL {self.sasl_ssl_bootstrap} (SCRAM-SHA-512, SCRAM-SHA-256, PLAIN; "
                f"user {KAFKA_USER}), SSL with client certificates {self.ssl_bootstrap}")


def wanted_secure_listeners() -> SecureListeners:
    return SecureListeners(env.kafka_sasl_ssl_port(), env.kafka_ssl_port())


def sasl_ssl_security(secrets: DevSecrets, mechanism: str = "SCRAM-SHA-512") -> KafkaSecurity:
    """How a client authenticates on the SASL_SSL listener of the secure dev broker."""
    return KafkaSecurity(protocol="SASL_SSL", mechanism=mechanism, username=KAFKA_USER,
                         password=secrets.kafka_password(), ca_location=str(secrets.ca))


def ensure_scram_user(bootstrap: str, secrets: DevSecrets) -> None:
    """The dev user's SCRAM credentials (both hashes), written over the PLAINTEXT listener;
    idempotent."""
    admin = AdminClient(librdkafka_conf(bootstrap, PLAINTEXT, logger=_SILENT))
    password = secrets.kafka_password().encode()
    try:
        # one request per mechanism: the broker refuses two changes of a user in one
        for mechanism in (ScramMechanism.SCRAM_SHA_512, ScramMechanism.SCRAM_SHA_256):
            upsert = UserScramCredentialUpsertion(
                KAFKA_USER, ScramCredentialInfo(mechanism, SCRAM_ITERATIONS), password)
            for future in admin.alter_user_scram_credentials([upsert],
                                                             request_timeout=30).values():
                future.result(timeout=35)
    except (KafkaException, TimeoutError) as exc:
        raise DevStackError(f"Could not write the SCRAM credentials of {KAFKA_USER!r} to the "
                            f"dev broker at {bootstrap}: {exc}") from None
