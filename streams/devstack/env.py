"""Environment knobs of the local stack (beyond those in `streams.config.settings`).

They exist mainly so a test can run a second, throwaway stack next to the default one:
other ports plus another `STOVEPIPE_HOME`.
"""

from __future__ import annotations

import os

from streams.config import settings as settings_mod

from .common import DevStackError

ENV_DEV_KAFKA_PORT = "STOVEPIPE_DEV_KAFKA_PORT"
ENV_DEV_KAFKA_CONTROLLER_PORT = "STOVEPIPE_DEV_KAFKA_CONTROLLER_PORT"
ENV_DEV_POSTGRES_PORT = "STOVEPIPE_DEV_POSTGRES_PORT"
ENV_DEV_KAFKA_SASL_SSL_PORT = "STOVEPIPE_DEV_KAFKA_SASL_SSL_PORT"
ENV_DEV_KAFKA_SSL_PORT = "STOVEPIPE_DEV_KAFKA_SSL_PORT"


def _port(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        port = int(raw)
    except ValueError:
        port = 0
    if not 0 < port < 65536:
        raise DevStackError(f"{name}={raw!r} is not a TCP port number (1-65535).")
    return port


def kafka_port() -> int:
    return _port(ENV_DEV_KAFKA_PORT, settings_mod.LOCAL_KAFKA_PORT)


def kafka_controller_port() -> int:
    return _port(ENV_DEV_KAFKA_CONTROLLER_PORT, settings_mod.LOCAL_KAFKA_CONTROLLER_PORT)


def kafka_sasl_ssl_port() -> int:
    return _port(ENV_DEV_KAFKA_SASL_SSL_PORT, settings_mod.LOCAL_KAFKA_SASL_SSL_PORT)


def kafka_ssl_port() -> int:
    return _port(ENV_DEV_KAFKA_SSL_PORT, settings_mod.LOCAL_KAFKA_SSL_PORT)


def postgres_port() -> int:
    return _port(ENV_DEV_POSTGRES_PORT, settings_mod.LOCAL_POSTGRES_PORT)

