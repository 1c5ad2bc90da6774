"""The local development stack: a real Kafka broker and PostgreSQL, no Docker needed.

`stovepipe dev up|down|status` is the command-line face; tests and tools call
`ensure_up(load_settings())` and use `.kafka_bootstrap` / `.postgres_dsn`.
"""

from .common import DevStackError, ServiceStatus, ServiceUp
from .env import ENV_DEV_KAFKA_CONTROLLER_PORT, ENV_DEV_KAFKA_PORT, ENV_DEV_POSTGRES_PORT
from .kafka_install import KAFKA_VERSION
from .postgres import postgres_root
from .stack import Stack, ensure_up, stack_status, stop_stack

__all__ = [
    "ENV_DEV_KAFKA_CONTROLLER_PORT",
    "ENV_DEV_KAFKA_PORT",
    "ENV_DEV_POSTGRES_PORT",
    "KAFKA_VERSION",
    "DevStackError",
    "ServiceStatus",
    "ServiceUp",
    "Stack",
    "ensure_up",
    "postgres_root",
    "stack_status",
    "stop_stack",
]
