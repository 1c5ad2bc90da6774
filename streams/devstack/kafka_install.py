"""The dev-stack Kafka broker's installation: its jars, fetched once from Maven Central
by Maven into `<settings.home>/cache/kafka-<ver>/` (kept while the pom is unchanged), and
the Java that runs them. Each missing tool is an error naming how to install it."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import time
from importlib import resources
from pathlib import Path

from streams.config.settings import Settings

from .common import DevStackError, Echo, log_hint, write_text_atomic

KAFKA_VERSION = "4.1.2"
SCALA_VERSION = "2.13"
MIN_JAVA = 17
MAVEN_TIMEOUT = 900.0
LABEL = f"Kafka {KAFKA_VERSION}"
_INSTALL_JAVA = "apt-get update && apt-get install -y openjdk-17-jre-headless"
_INSTALL_MAVEN = "apt-get update && apt-get install -y maven"


def resource_text(name: str) -> str:
    return resources.files("streams.devstack").joinpath(name).read_text()


def cache_dir(settings: Settings) -> Path:
    return settings.home / "cache" / f"kafka-{KAFKA_VERSION}"


def libs_dir(settings: Settings) -> Path:
    return cache_dir(settings) / "libs"


# --- the jars --------------------------------------------------------------------------


def _libs_cached(cache: Path, pom_digest: str) -> bool:
    marker = cache / ".complete"
    try:
        recorded = marker.read_text().strip()
    except OSError:
        return False
    return recorded == pom_digest and (
        cache / "libs" / f"kafka_{SCALA_VERSION}-{KAFKA_VERSION}.jar"
    ).is_file()


def ensure_libs(settings: Settings, echo: Echo) -> Path:
    """The directory of the broker's jars; runs Maven only when they are not cached yet."""
    cache = cache_dir(settings)
    pom_text = resource_text("kafka-pom.xml")
    digest = hashlib.sha256(pom_text.encode()).hexdigest()
    libs = cache / "libs"
    if _libs_cached(cache, digest):
        return libs
    mvn = shutil.which("mvn")
    if mvn is None:
        raise DevStackError(
            f"Maven (`mvn`) is not installed; it fetches {LABEL} from Maven Central once. "
            f"Install it: {_INSTALL_MAVEN}"
        )
    echo(f"{LABEL}: fetching the broker from Maven Central (once; cached in {libs}) ...")
    started = time.monotonic()
    cache.mkdir(parents=True, exist_ok=True)
    (cache / ".complete").unlink(missing_ok=True)
    pom = cache / "pom.xml"
    pom.write_text(pom_text)
    partial = cache / "libs.partial"
    shutil.rmtree(partial, ignore_errors=True)
    maven_log = cache / "maven.log"
    cmd = [mvn, "-q", "-B", "-f", str(pom), "package", f"-Dlibs.dir={partial}"]
    try:
        with maven_log.open("w") as out:
            code = subprocess.run(
                cmd, cwd=cache, stdin=subprocess.DEVNULL, stdout=out,
                stderr=subprocess.STDOUT, timeout=MAVEN_TIMEOUT, check=False,
            ).returncode
    except subprocess.TimeoutExpired:
        raise DevStackError(
            f"Maven did not finish fetching {LABEL} within {MAVEN_TIMEOUT:.0f} s. "
            f"{log_hint(maven_log)}"
        ) from None
    if code != 0 or not (partial / f"kafka_{SCALA_VERSION}-{KAFKA_VERSION}.jar").is_file():
        raise DevStackError(
            f"Maven could not fetch {LABEL} from Maven Central (`{' '.join(cmd)}` "
            f"exited with {code}). Is Maven Central reachable? {log_hint(maven_log)}"
        )
    shutil.rmtree(libs, ignore_errors=True)
    partial.rename(libs)
    shutil.rmtree(cache / "target", ignore_errors=True)
    write_text_atomic(cache / ".complete", digest + "\n")
    jars = len(list(libs.glob("*.jar")))
    echo(f"{LABEL}: {jars} jars fetched in {time.monotonic() - started:.1f} s")
    return libs


# --- java ------------------------------------------------------------------------------


def find_java() -> str:
    java_home = os.environ.get("JAVA_HOME", "").strip()
    if java_home and os.access(Path(java_home) / "bin" / "java", os.X_OK):
        return str(Path(java_home) / "bin" / "java")
    java = shutil.which("java")
    if java is None:
        raise DevStackError(
            f"Java is not installed; {LABEL} needs Java {MIN_JAVA} or newer. "
            f"Install it: {_INSTALL_JAVA}"
        )
    return java


def java_major(java: str) -> int | None:
    try:
        out = subprocess.run(
            [java, "-version"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = re.search(r'version "(\d+)(?:\.(\d+))?', out.stderr + out.stdout)
    if not match:
        return None
    major = int(match.group(1))
    if major == 1 and match.group(2):  # "1.8.0_392"
        major = int(match.group(2))
    return major


def check_java(java: str) -> None:
    major = java_major(java)
    if major is not None and major < MIN_JAVA:
        raise DevStackError(
            f"{java} is Java {major}; {LABEL} needs Java {MIN_JAVA} or newer. "
            f"Install it ({_INSTALL_JAVA}) and put it first on PATH or set JAVA_HOME."
        )
