"""Regenerate the Python modules and type stubs for the `.proto` files in `contract/pb/`.

Usage, from anywhere::

    python -m contract.generate           # rewrite contract/pb/*_pb2.py and *_pb2.pyi
    python -m contract.generate --check   # exit 1 if the committed files are stale
    python -m contract.generate --snapshot NAME
                                          # keep the contract's descriptor set as
                                          # contract/history/NAME.binpb (a release's)

The generated files are committed. Their bytes depend on the protoc bundled with
grpcio-tools and on mypy-protobuf, so regenerate with the versions pyproject pins.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from importlib import resources
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = REPO_ROOT / "contract" / "pb"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi")


class GenerateError(RuntimeError):
    """protoc or its mypy plugin failed or is missing."""


def proto_files() -> list[Path]:
    return sorted(PROTO_DIR.glob("*.proto"))


def _mypy_plugin() -> str:
    # Prefer the plugin installed next to this interpreter, so a venv works un-activated.
    beside = Path(sys.executable).parent / "protoc-gen-mypy"
    if beside.exists():
        return str(beside)
    found = shutil.which("protoc-gen-mypy")
    if found is None:
        raise GenerateError("protoc-gen-mypy not found: pip install -e '.[dev]'")
    return found


def generate(out_dir: Path) -> list[Path]:
    """Run protoc over every proto in `contract/pb/`, writing under `out_dir`.

    Output paths mirror the repo (`out_dir/contract/pb/x_pb2.py`), so generated imports
    read `from contract.pb import x_pb2`. Returns the generated files, sorted.
    """
    # Deferred: grpcio-tools is a dev dependency; the package must import without it.
    from grpc_tools import protoc

    protos = proto_files()
    if not protos:
        raise GenerateError(f"no .proto files in {PROTO_DIR}")
    well_known = resources.files("grpc_tools") / "_proto"
    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{REPO_ROOT}",
        f"-I{well_known}",
        f"--plugin=protoc-gen-mypy={_mypy_plugin()}",
        f"--python_out={out_dir}",
        f"--mypy_out=quiet:{out_dir}",
        *(str(p.relative_to(REPO_ROOT)) for p in protos),
    ]
    if protoc.main(args) != 0:
        raise GenerateError("protoc failed (see its message above)")
    return generated_files(out_dir / "contract" / "pb")


def descriptor_set(root: Path = REPO_ROOT) -> bytes:
    """The FileDescriptorSet of the protos under ``root``/contract/pb (with their imports):
    what `contract.compat` compares across releases."""
    from grpc_tools import protoc

    protos = sorted((root / "contract" / "pb").glob("*.proto"))
    if not protos:
        raise GenerateError(f"no .proto files in {root / 'contract' / 'pb'}")
    well_known = resources.files("grpc_tools") / "_proto"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "set.binpb"
        args = ["grpc_tools.protoc", f"-I{root}", f"-I{well_known}", "--include_imports",
                f"--descriptor_set_out={out}", *(str(p.relative_to(root)) for p in protos)]
        if protoc.main(args) != 0:
            raise GenerateError("protoc failed (see its message above)")
        return out.read_bytes()


def generated_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.name.endswith(GENERATED_SUFFIXES))


def stale_files(committed_dir: Path = PROTO_DIR) -> list[str]:
    """Names of generated files in `committed_dir` that differ from a fresh generation.

    Includes files that are missing and files left behind by a deleted proto.
    """
    with tempfile.TemporaryDirectory() as tmp:
        fresh = {p.name: p.read_bytes() for p in generate(Path(tmp))}
    committed = {p.name: p.read_bytes() for p in generated_files(committed_dir)}
    names = sorted(fresh.keys() | committed.keys())
    return [n for n in names if fresh.get(n) != committed.get(n)]


def write() -> list[Path]:
    """Regenerate into `contract/pb/`, removing generated files with no proto left."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        fresh_names = {p.name for p in fresh}
        for old in generated_files(PROTO_DIR):
            if old.name not in fresh_names:
                old.unlink()
        written = []
        for src in fresh:
            dest = PROTO_DIR / src.name
            shutil.copyfile(src, dest)
            written.append(dest)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m contract.generate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true",
                        help="do not write; exit 1 if the committed files are stale")
    parser.add_argument("--snapshot", metavar="NAME",
                        help="write the contract's descriptor set to "
                             "contract/history/NAME.binpb")
    args = parser.parse_args(argv)
    try:
        if args.snapshot:
            if not all(c.isalnum() or c in "._-" for c in args.snapshot):
                print(f"error: {args.snapshot!r}: a name of letters, digits, '.', '_', '-'",
                      file=sys.stderr)
                return 1
            target = REPO_ROOT / "contract" / "history" / f"{args.snapshot}.binpb"
            target.parent.mkdir(exist_ok=True)
            target.write_bytes(descriptor_set())
            print(f"wrote {target.relative_to(REPO_ROOT)}")
            return 0
        if args.check:
            stale = stale_files()
            if stale:
                print("stale generated files (run `python -m contract.generate`): "
                      + ", ".join(stale), file=sys.stderr)
                return 1
            print("generated files are up to date")
            return 0
        for path in write():
            print(f"wrote {path.relative_to(REPO_ROOT)}")
    except GenerateError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
