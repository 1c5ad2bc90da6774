"""The tree keeps the shape the README describes: every module imports on its own (no
import cycle hides behind a package's __init__), and no module grows past a size a
newcomer can read in one sitting. The layers themselves are import-linter contracts
(pyproject.toml), checked by `make lint`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from streams.config.settings import REPO_ROOT

PACKAGES = ("contract", "store", "streams")
MAX_MODULE_LINES = 500
GENERATED = ("_pb2.py", "_pb2.pyi")


def _modules() -> list[str]:
    found = []
    for package in PACKAGES:
        for path in sorted((REPO_ROOT / package).rglob("*.py")):
            if path.name.endswith(GENERATED) or path.name == "__main__.py":
                continue
            parts = path.relative_to(REPO_ROOT).with_suffix("").parts
            found.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return found


_IMPORT_EACH_ALONE = """
import importlib, sys
from prometheus_client import REGISTRY
failed = []
for name in sys.argv[1:]:
    for loaded in [m for m in sys.modules if m.split('.')[0] in ('contract', 'store', 'streams')]:
        del sys.modules[loaded]
    for collector in list(REGISTRY._collector_to_names):  # our metrics register on import
        REGISTRY.unregister(collector)
    try:
        importlib.import_module(name)
    except Exception as exc:
        failed.append(f"{name}: {type(exc).__name__}: {exc}")
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""


def test_every_module_imports_first_in_a_fresh_interpreter() -> None:
    modules = _modules()
    assert "streams.stages.process" in modules and "streams.cli" in modules
    result = subprocess.run([sys.executable, "-c", _IMPORT_EACH_ALONE, *modules],
                            capture_output=True, text=True, cwd=REPO_ROOT, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr


def test_no_module_is_longer_than_a_sitting() -> None:
    long = {}
    for package in PACKAGES:
        for path in (REPO_ROOT / package).rglob("*.py"):
            if path.name.endswith(GENERATED):
                continue
            lines = len(path.read_text(encoding="utf-8").splitlines())
            if lines > MAX_MODULE_LINES:
                long[str(Path(path).relative_to(REPO_ROOT))] = lines
    assert not long, f"split these by concern (at most {MAX_MODULE_LINES} lines): {long}"
