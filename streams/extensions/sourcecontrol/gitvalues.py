"""The queues.yaml value types of a git repository: a branch name, a repository (a remote
URL as written, or a local path made absolute against the file's directory)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import AfterValidator, BeforeValidator, ValidationInfo

from streams.extensions.sourcecontrol.gituri import check_branch_name, is_remote_url
from streams.schema.fields import NonEmptyStr, resolve_path


def _branch(value: object) -> str:
    if not isinstance(value, str):
        raise ValueError(f"expected a non-empty string without surrounding spaces, got "
                         f"{value!r}")
    return check_branch_name(value)


def _repository(value: str, info: ValidationInfo) -> str:
    """A remote URL as written, or a local path made absolute (against the file's
    directory)."""
    return value if is_remote_url(value) else str(resolve_path(Path(value), info))


BranchName = Annotated[str, BeforeValidator(_branch)]
Repository = Annotated[NonEmptyStr, AfterValidator(_repository)]
