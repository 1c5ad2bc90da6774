"""SourceControl: how Stovepipe sees a queue's repository (design §8)."""

from streams.sourcecontrol.contract import (
    CommitNotFound,
    SourceControl,
    SourceControlError,
    UnknownRef,
)

__all__ = ["CommitNotFound", "SourceControl", "SourceControlError", "UnknownRef"]
