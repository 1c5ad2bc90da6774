"""Bounded logging: no value, line or outage floods the worker's log (design §6).

- `bounded(text)`: a value cut to `FIELD_LIMIT` characters, with its full length noted —
  for ids, keys and error texts in log lines, headers and parked rows.
- `LineLimit`: a handler filter that cuts every log line to `LINE_LIMIT` characters.
- `Repeats`: a handler filter that lets through, per logger and message template, one
  warning or error every `window` seconds during a flood, then says how many it held back.
  It applies to the Kafka and database clients' own loggers, which during an outage log
  every reconnect attempt, to the runtime's outage lines, and to the web server's and the
  webhooks' refusals.
- `install()`: both filters on every handler of the root logger (the worker calls it once
  logging is configured).
"""

from __future__ import annotations

import logging
import time

FIELD_LIMIT = 256
LINE_LIMIT = 4096
REPEAT_WINDOW = 10.0
# loggers whose warnings and errors are rate-limited: the clients' reconnect chatter, our
# own lines written once per retry of an unreachable dependency, and the web server's and
# the webhooks' (anyone who can reach the port can send requests that are refused)
FLOODING_LOGGERS = ("aiokafka", "kafka", "faust", "mode", "psycopg", "stovepipe.outage",
                    "stovepipe.delay", "aiohttp.server", "stovepipe.webhooks")


def bounded(value: object, limit: int = FIELD_LIMIT) -> str:
    """``value`` as text, at most about ``limit`` characters, its full length noted."""
    text = value if isinstance(value, str) else str(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}…({len(text)} chars)"


class LineLimit(logging.Filter):
    """Cuts a record's final message to ``limit`` characters (arguments included)."""

    def __init__(self, limit: int = LINE_LIMIT) -> None:
        super().__init__()
        self.limit = limit

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if len(message) > self.limit or record.exc_info:
            if record.exc_info and record.exc_text is None:
                # a traceback's text is bounded too (its own lines are code, not data)
                record.exc_text = logging.Formatter().formatException(record.exc_info)
            if record.exc_text and len(record.exc_text) > self.limit:
                record.exc_text = bounded(record.exc_text, self.limit)
            record.msg, record.args = bounded(message, self.limit), ()
        return True


class Repeats(logging.Filter):
    """One warning-or-worse per (logger, template) per ``window`` seconds from the
    flooding loggers; the next one let through says how many were held back."""

    def __init__(self, window: float = REPEAT_WINDOW,
                 loggers: tuple[str, ...] = FLOODING_LOGGERS) -> None:
        super().__init__()
        self.window = window
        self.loggers = loggers
        self._last: dict[tuple[str, str], tuple[float, int]] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING or not record.name.startswith(self.loggers):
            return True
        key = (record.name, str(record.msg)[:200])
        now = time.monotonic()
        last = self._last.get(key)
        if last is not None and now - last[0] < self.window:
            self._last[key] = (last[0], last[1] + 1)
            return False
        held = last[1] if last is not None else 0
        self._last[key] = (now, 0)
        if len(self._last) > 10_000:  # templates are few; a flood of distinct ones is not
            self._last.clear()
        if held:
            record.msg = f"{record.getMessage()} ({held} more like this in the last " \
                         f"{self.window:.0f}s not shown)"
            record.args = ()
        return True


def install(root: logging.Logger | None = None) -> None:
    """Both filters on every handler of ``root`` (default: the root logger); idempotent."""
    target = root or logging.getLogger()
    for handler in target.handlers:
        if not any(isinstance(f, LineLimit) for f in handler.filters):
            handler.addFilter(Repeats())
            handler.addFilter(LineLimit())
