"""PostgreSQL state: migrations, entities, one store per entity, typed errors.

Stages use `Database` (a pool plus the stores), its `transaction()` for writes that must
commit together, the entities and enums, and `is_retryable` to classify failures.
"""

from store.database import Database, Stores, Transaction
from store.entities import (
    Build,
    BuildStatus,
    BuildStrategy,
    CommandBuild,
    DeliveryState,
    ParkedMessage,
    Queue,
    Request,
    RequestKind,
    RequestState,
    RequestUri,
    ValidationFact,
    Verdict,
    WebhookDelivery,
    make_request_id,
    parse_request_id,
    request_order,
    request_seq,
    request_validation,
)
from store.errors import (
    AlreadyExists,
    AmbiguousKey,
    InvariantViolation,
    MigrationError,
    NotFound,
    StoreError,
    VersionMismatch,
    is_retryable,
)

__all__ = [
    "AlreadyExists",
    "AmbiguousKey",
    "Build",
    "BuildStatus",
    "BuildStrategy",
    "CommandBuild",
    "Database",
    "DeliveryState",
    "InvariantViolation",
    "MigrationError",
    "NotFound",
    "ParkedMessage",
    "Queue",
    "Request",
    "RequestKind",
    "RequestState",
    "RequestUri",
    "StoreError",
    "Stores",
    "Transaction",
    "ValidationFact",
    "Verdict",
    "VersionMismatch",
    "WebhookDelivery",
    "is_retryable",
    "make_request_id",
    "parse_request_id",
    "request_order",
    "request_seq",
    "request_validation",
]
