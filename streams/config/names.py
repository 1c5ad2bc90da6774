"""Queue names and the errors about queues a user can cause: what the command line and the
HTTP API check before anything else (kept apart from the queues.yaml models, so a command
that only reads the database starts without loading them)."""

from __future__ import annotations

import re
from pathlib import Path

from streams.config.settings import ENV_QUEUES_FILE

MAX_QUEUE_NAME_LENGTH = 200
_QUEUE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]*")
_QUEUE_NAME_RULE = (f"1-{MAX_QUEUE_NAME_LENGTH} characters: ASCII letters, digits, '.', "
                    f"'_', '-' and '/', starting with a letter or digit, without '//' "
                    f"and not ending in '/'")
UNKNOWN_QUEUE_LISTS_AT_MOST = 10


class InvalidQueueName(ValueError):
    """A queue name that breaks the naming rule: a user error."""


class UnknownQueue(LookupError):
    """No queue of that name in the queue configuration: a user error."""

    retryable = False

    def __init__(self, queue: str, path: Path, known: tuple[str, ...]) -> None:
        self.queue = queue
        self.path = path
        self.known = known
        if not known:
            declared = "declares no queues"
        elif len(known) <= UNKNOWN_QUEUE_LISTS_AT_MOST:
            declared = f"declares {', '.join(known)}"
        else:
            declared = f"declares {len(known)} others"
        super().__init__(f"unknown queue {_shown(queue)}: {path} {declared}. Add the queue "
                         f"there, or set {ENV_QUEUES_FILE} to the file that has it.")


class QueueConfigError(ValueError):
    """queues.yaml is unreadable or invalid. `problems` lists each one, YAML path named."""

    def __init__(self, path: Path, problems: list[str]) -> None:
        self.path = path
        self.problems = problems
        lines = "\n".join(f"  {problem}" for problem in problems)
        super().__init__(f"{path}: {len(problems)} problem(s):\n{lines}")


def _shown(name: str) -> str:
    return repr(name) if len(name) <= 80 else f"{name[:60]!r}... ({len(name)} chars)"


def validate_queue_name(name: object) -> str:
    """``name`` if it is a valid queue name, else InvalidQueueName saying why."""
    if not isinstance(name, str):
        raise InvalidQueueName(f"a queue name is a string, got {name!r}")
    valid = _QUEUE_NAME.match(name)
    reason = None
    if not name:
        reason = "it is empty"
    elif len(name) > MAX_QUEUE_NAME_LENGTH:
        reason = f"it is {len(name)} characters long"
    elif valid is None:
        reason = f"it starts with {name[0]!r}, not a letter or digit"
    elif valid.end() < len(name):
        reason = f"it contains {name[valid.end()]!r}"
    elif "//" in name:
        reason = "it contains '//'"
    elif name.endswith("/"):
        reason = "it ends in '/'"
    if reason:
        raise InvalidQueueName(f"invalid queue name {_shown(name)}: {reason}; a queue name is "
                               f"{_QUEUE_NAME_RULE}")
    return name


def validate_queue_or_scope_name(name: object) -> str:
    """``name`` if it names a queue or a project's scope (``<queue>#<project>``, whose
    Requests and builds are named by it), else InvalidQueueName saying why."""
    if not isinstance(name, str):
        raise InvalidQueueName(f"a queue name is a string, got {name!r}")
    queue, sep, project = name.partition("#")
    validate_queue_name(queue)
    if sep:
        from streams.config.projects import validate_project_name  # only for scopes

        try:
            validate_project_name(project)
        except ValueError as exc:
            raise InvalidQueueName(f"{_shown(name)} names queue {queue!r} and a project: "
                                   f"{exc}") from None
    return name
