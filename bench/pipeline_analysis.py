"""Reading what `bench/pipeline_bench.py` measured: Prometheus scrapes, percentiles, CPU
counters and py-spy / cProfile output. Pure helpers, no I/O beyond reading files."""

from __future__ import annotations

import math
import os
import pstats
import re
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

# --- percentiles ---------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """The q-quantile (0..1) by linear interpolation; nan for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def ms(seconds: float) -> str:
    return "-" if math.isnan(seconds) else f"{seconds * 1000:.1f}"


# --- Prometheus ----------------------------------------------------------------------

Sample = tuple[str, frozenset[tuple[str, str]]]


def parse_metrics(text: str) -> dict[Sample, float]:
    """Every sample of a /metrics page, keyed by (sample name, labels)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[Sample, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def delta(after: Mapping[Sample, float], before: Mapping[Sample, float]) -> dict[Sample, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def by_label(samples: Mapping[Sample, float], name: str, label: str,
             **where: str) -> dict[str, float]:
    """``name``'s samples summed by the value of ``label``, filtered by ``where``."""
    out: dict[str, float] = defaultdict(float)
    for (sample, labels), value in samples.items():
        if sample != name:
            continue
        lab = dict(labels)
        if all(lab.get(k) == v for k, v in where.items()):
            out[lab.get(label, "")] += value
    return dict(out)


@dataclass(frozen=True)
class HistogramView:
    count: float
    total: float
    buckets: tuple[tuple[float, float], ...]  # (upper bound, cumulative count)

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else math.nan

    def quantile(self, q: float) -> float:
        """Estimated like Prometheus' histogram_quantile (linear within the bucket)."""
        if not self.count:
            return math.nan
        rank = q * self.count
        prev_bound, prev_count = 0.0, 0.0
        for bound, cum in self.buckets:
            if cum >= rank:
                if math.isinf(bound):
                    return prev_bound
                width = cum - prev_count
                frac = (rank - prev_count) / width if width else 1.0
                return prev_bound + (bound - prev_bound) * frac
            prev_bound, prev_count = bound, cum
        return prev_bound


def histogram(samples: Mapping[Sample, float], name: str, **where: str) -> HistogramView:
    count = total = 0.0
    buckets: dict[float, float] = defaultdict(float)
    for (sample, labels), value in samples.items():
        lab = dict(labels)
        if not all(lab.get(k) == v for k, v in where.items()):
            continue
        if sample == f"{name}_count":
            count += value
        elif sample == f"{name}_sum":
            total += value
        elif sample == f"{name}_bucket":
            buckets[float(lab["le"])] += value
    return HistogramView(count, total, tuple(sorted(buckets.items())))


# --- CPU -----------------------------------------------------------------------------

CLK_TCK = os.sysconf("SC_CLK_TCK")


def process_cpu_seconds(pid: int) -> float:
    """utime + stime of a process and its threads, in seconds (0 when it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def thread_cpu_seconds(pid: int) -> dict[int, float]:
    """utime + stime of each thread of a process, by thread id."""
    out = {}
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(task.name)] = (int(fields[11]) + int(fields[12])) / CLK_TCK
    return out


def cpu_by_group(named: Mapping[int, str]) -> dict[str, float]:
    """CPU seconds used so far by every live process, grouped: the pids in ``named`` under
    their name, then by command (postgres, java = Kafka, other python, other). A process
    that exits between two readings drops out of the later one: compare deltas only."""
    out: dict[str, float] = defaultdict(float)
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        pid = int(stat.parent.name)
        comm = text[text.index("(") + 1:text.rindex(")")]
        fields = text.rsplit(")", 1)[1].split()
        cpu = (int(fields[11]) + int(fields[12])) / CLK_TCK
        if pid in named:
            group = named[pid]
        elif comm.startswith("postgres"):
            group = "postgres"
        elif comm == "java":
            group = "java (Kafka)"
        elif comm.startswith("python"):
            group = "other python"
        elif comm.startswith("pytest"):
            group = "pytest (other sessions)"
        else:
            group = "other"
        out[group] += cpu
    return dict(out)


def machine_cpu() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine, in seconds."""
    parts = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = parts[3] + (parts[4] if len(parts) > 4 else 0)
    return (sum(parts) - idle) / CLK_TCK, sum(parts) / CLK_TCK


# --- py-spy --------------------------------------------------------------------------

_FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^()]*):(?P<line>\d+)\)$")

AREAS: tuple[tuple[str, str], ...] = (
    ("streams/sourcecontrol", "fake repository (json + flock)"),
    ("streams/buildrunner", "fake build runner"),
    ("streams/", "stovepipe stages + runtime"),
    ("store/", "stovepipe store"),
    ("contract/", "contract (protojson)"),
    ("google/protobuf", "protobuf"),
    ("faust/", "faust"),
    ("mode/", "mode (faust services)"),
    ("aiokafka/", "aiokafka"),
    ("kafka/", "aiokafka"),
    ("psycopg_pool/", "psycopg"),
    ("psycopg/", "psycopg"),
    ("prometheus_client/", "prometheus_client"),
    ("logging/", "logging"),
    ("asyncio/", "asyncio event loop"),
    ("selectors.py", "asyncio event loop"),
    ("json/", "json"),
    ("concurrent/futures", "thread pool"),
    ("threading.py", "thread pool"),
)


def area_of(file: str) -> str:
    for needle, name in AREAS:
        if needle in file:
            return name
    return "other: " + file.rsplit("/", 1)[-1]


def _split(frame: str) -> tuple[str, str]:
    m = _FRAME.match(frame)
    return (m.group("func"), m.group("file")) if m else (frame, "")


@dataclass
class SpyProfile:
    samples: int
    by_thread: Counter[str]
    by_area: Counter[str]  # leaf frame's area (self time)
    by_leaf: Counter[str]  # leaf function (self time)
    inclusive: Counter[str]  # functions of interest, counted once per stack


INCLUSIVE_OF_INTEREST = (
    "Delivery.deliver", "handle_ingest", "handle_process", "handle_build",
    "handle_buildsignal", "handle_record", "publish_payload", "send_and_wait",
    "Database.transaction", "_fetch_one", "_compare_and_set", "AsyncCursor.execute",
    "AsyncConnectionPool.connection", "Logger._log", "LoggerAdapter.info", "marshal",
    "unmarshal", "_drain_messages", "Consumer._drain_messages", "_fetch_records",
    "DelayScheduler._fetch_loop", "_forward_when_due", "Sender._sender_routine",
    "Fetcher._fetch_requests_routine", "AIOKafkaClient._md_synchronizer",
    "Service._execute_actor", "Agent._slurp", "Stream.__anext__", "_commit",
    "Consumer.commit", "Consumer._commit_offsets", "_sleep", "MetricCollector",
)


def read_pyspy_raw(path: Path) -> SpyProfile:
    prof = SpyProfile(0, Counter(), Counter(), Counter(), Counter())
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = stack.split(";")
        thread = frames[0]
        if thread.startswith("thread ("):
            thread = thread.split(": ", 1)[-1]
            frames = frames[1:]
        if thread.startswith(("asyncio_", "ThreadPoolExecutor")):
            thread = "to_thread pool"
        prof.samples += count
        prof.by_thread[thread] += count
        if not frames:
            continue
        func, file = _split(frames[-1])
        prof.by_area[area_of(file)] += count
        prof.by_leaf[f"{func} ({file.rsplit('/', 2)[-2:][0]}/{file.rsplit('/', 1)[-1]})"
                     if "/" in file else f"{func} ({file})"] += count
        seen = set()
        for frame in frames:
            name = _split(frame)[0]
            if name in INCLUSIVE_OF_INTEREST and name not in seen:
                seen.add(name)
                prof.inclusive[name] += count
    return prof


# --- cProfile ------------------------------------------------------------------------


def cprofile_report(path: Path, limit: int = 20) -> list[str]:
    """Own time (tottime) by area and by function, and the cumulative time of the
    functions of interest, from a cProfile dump."""
    stats = pstats.Stats(str(path))
    rows = []
    areas: Counter[str] = Counter()
    cumulative: Counter[str] = Counter()
    for (file, line, func), (_cc, ncalls, tottime, cumtime, _callers) in \
            stats.stats.items():  # type: ignore[attr-defined]
        rows.append((tottime, cumtime, ncalls, f"{func} ({Path(file).name}:{line})"))
        areas[area_of(file) if file != "~" else _builtin_area(func)] += tottime
        qualified = func.split(".")[-1]
        if func in INCLUSIVE_OF_INTEREST or qualified in {
                f.split(".")[-1] for f in INCLUSIVE_OF_INTEREST}:
            cumulative[f"{func} ({Path(file).name})"] = max(
                cumulative[f"{func} ({Path(file).name})"], cumtime)
    rows.sort(reverse=True)
    total = sum(r[0] for r in rows) or 1.0
    out = [f"main-thread CPU profiled: {total:.1f} s",
           "own time by area: " + ", ".join(f"{a} {100 * t / total:.1f}%"
                                            for a, t in areas.most_common(14)),
           "cumulative (CPU while running, coroutine resumptions summed): " + ", ".join(
               f"{f} {100 * t / total:.1f}%" for f, t in cumulative.most_common(16)),
           "top own-time functions:"]
    out += [f"  {100 * tt / total:5.1f}%  calls {n:>9}  {name}"
            for tt, _cum, n, name in rows[:limit]]
    return out


def _builtin_area(func: str) -> str:
    """Area of a C function (cProfile's file ``~``), e.g. ``<method 'send' of ...>``."""
    if "socket" in func or "send" in func or "recv" in func:
        return "socket syscalls"
    if "select" in func or "poll" in func:
        return "asyncio event loop"
    if "psycopg" in func or "PGconn" in func or "pq" in func:
        return "psycopg"
    if "json" in func or "dumps" in func or "loads" in func:
        return "json"
    return "builtins (other)"
