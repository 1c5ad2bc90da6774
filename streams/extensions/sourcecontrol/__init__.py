"""SourceControl: how Stovepipe sees a queue's repository (design §8).

The kinds a queue may name in queues.yaml are the members of `SourceControlSpec`: add a
kind by writing its module (a spec class with ``kind`` and ``build``, and the extension)
and adding its spec here.
"""

from streams.extensions.sourcecontrol.commits import commit_sha
from streams.extensions.sourcecontrol.contract import (
    AmbiguousCommit,
    CommitInfo,
    CommitNotFound,
    NotOnFirstParent,
    PromotionMoved,
    SourceControl,
    SourceControlError,
    TooManyCommits,
    TooManyPaths,
    UnknownRef,
)
from streams.extensions.sourcecontrol.fake import FakeSourceControlSpec
from streams.extensions.sourcecontrol.git import GitSourceControlSpec

# The registry of kinds, in the order error messages list them.
SourceControlSpec = FakeSourceControlSpec | GitSourceControlSpec

__all__ = [
    "AmbiguousCommit",
    "CommitInfo",
    "CommitNotFound",
    "NotOnFirstParent",
    "PromotionMoved",
    "SourceControl",
    "SourceControlError",
    "SourceControlSpec",
    "TooManyCommits",
    "TooManyPaths",
    "UnknownRef",
    "commit_sha",
]
