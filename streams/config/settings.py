"""Environment configuration with working local defaults.

Every knob a user may set through the environment lives here, read once per call so tests
can override the environment. The local stack (`stovepipe dev up`) listens on the defaults.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path

ENV_KAFKA_BOOTSTRAP = "STOVEPIPE_KAFKA_BOOTSTRAP"
ENV_POSTGRES_DSN = "STOVEPIPE_POSTGRES_DSN"
ENV_TOPIC_PREFIX = "STOVEPIPE_TOPIC_PREFIX"
ENV_TOPICS_FILE = "STOVEPIPE_TOPICS_FILE"
ENV_QUEUES_FILE = "STOVEPIPE_QUEUES_FILE"
ENV_HOME = "STOVEPIPE_HOME"
ENV_APP_ID = "STOVEPIPE_APP_ID"
ENV_WEB_PORT = "STOVEPIPE_WEB_PORT"
ENV_API_TOKEN = "STOVEPIPE_API_TOKEN"  # noqa: S105 - the variable's name, not a token
ENV_SWEEP_INTERVAL = "STOVEPIPE_SWEEP_INTERVAL"
ENV_MAX_IN_FLIGHT = "STOVEPIPE_MAX_IN_FLIGHT"
ENV_DB_POOL = "STOVEPIPE_DB_POOL"
ENV_HOST_ID = "STOVEPIPE_HOST_ID"
ENV_PUBLIC_URL = "STOVEPIPE_PUBLIC_URL"  # where people reach the dashboard and API
ENV_WEBHOOK_BODIES = "STOVEPIPE_WEBHOOK_BODIES"
ENV_WEBHOOK_READ_TIMEOUT = "STOVEPIPE_WEBHOOK_READ_TIMEOUT"

LOCAL_KAFKA_PORT = 19092
LOCAL_KAFKA_CONTROLLER_PORT = 19093
LOCAL_POSTGRES_PORT = 15432
LOCAL_KAFKA_BOOTSTRAP = f"127.0.0.1:{LOCAL_KAFKA_PORT}"
LOCAL_POSTGRES_DSN = f"postgresql://stovepipe@127.0.0.1:{LOCAL_POSTGRES_PORT}/stovepipe"
DEFAULT_TOPIC_PREFIX = "stovepipe."
DEFAULT_APP_ID = "stovepipe"
DEFAULT_WEB_PORT = 6066
DEFAULT_MAX_IN_FLIGHT = 500  # messages under way at once per stage of one worker
DEFAULT_DB_POOL = 20  # PostgreSQL connections of one worker
DEFAULT_WEBHOOK_BODIES = 4  # webhook bodies one worker reads at once, per provider
# seconds a webhook body may take to arrive after its headers: github.com and gitlab.com
# give up on a delivery after 10 s (GitHub Enterprise Server after 30 s, a self-managed
# GitLab after its webhook_timeout), so a slower body has failed for its sender already
DEFAULT_WEBHOOK_READ_TIMEOUT = 10.0

REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Settings:
    kafka_bootstrap: str
    postgres_dsn: str
    topic_prefix: str
    topics_file: Path
    queues_file: Path
    home: Path
    kafka_from_env: bool
    postgres_from_env: bool
    host_id: str = ""  # set by load_settings (`host_id`)
    public_url: str | None = None  # e.g. https://stovepipe.example.com; links need it


def load_settings() -> Settings:
    kafka = os.environ.get(ENV_KAFKA_BOOTSTRAP, "").strip()
    dsn = os.environ.get(ENV_POSTGRES_DSN, "").strip()
    home = Path(os.environ.get(ENV_HOME) or Path.home() / ".stovepipe")
    return Settings(
        kafka_bootstrap=kafka or LOCAL_KAFKA_BOOTSTRAP,
        postgres_dsn=dsn or LOCAL_POSTGRES_DSN,
        topic_prefix=os.environ.get(ENV_TOPIC_PREFIX, DEFAULT_TOPIC_PREFIX),
        topics_file=Path(os.environ.get(ENV_TOPICS_FILE) or REPO_ROOT / "topics.yaml"),
        queues_file=Path(os.environ.get(ENV_QUEUES_FILE) or REPO_ROOT / "queues.yaml"),
        home=home,
        kafka_from_env=bool(kafka),
        postgres_from_env=bool(dsn),
        host_id=host_id(home),
        public_url=os.environ.get(ENV_PUBLIC_URL, "").strip().rstrip("/") or None,
    )


def host_id(home: Path) -> str:
    """This worker's host: what owns the builds it starts on this machine (the command
    build runner). ``STOVEPIPE_HOST_ID`` when set, else ``<hostname>:<resolved home>``, so
    two workers with different homes on one machine are two hosts, and two with the same
    home are one (they share its build directories)."""
    explicit = os.environ.get(ENV_HOST_ID, "").strip()
    if explicit:
        return explicit
    return f"{socket.gethostname()}:{home.expanduser().resolve()}"

