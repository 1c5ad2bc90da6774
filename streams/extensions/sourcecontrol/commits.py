"""The commit id inside a URI, for the one place outside the pipeline that needs it:
telling a forge which commit a status is about. Only the kinds that mint URIs read them."""

from __future__ import annotations

from streams.extensions.sourcecontrol.contract import CommitNotFound
from streams.extensions.sourcecontrol.fake import URI_SCHEME as FAKE_SCHEME
from streams.extensions.sourcecontrol.gituri import URI_PREFIX as GIT_PREFIX
from streams.extensions.sourcecontrol.gituri import parse_uri


def commit_sha(uri: str) -> str | None:
    """The commit ``uri`` names (a git sha; a fake commit's name), None when no kind of
    source control minted it."""
    if uri.startswith(GIT_PREFIX):
        try:
            return parse_uri(uri).sha
        except CommitNotFound:
            return None
    if uri.startswith(FAKE_SCHEME):
        _, sep, sha = uri.removeprefix(FAKE_SCHEME).rpartition("/")
        return sha if sep and sha else None
    return None
