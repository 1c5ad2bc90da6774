"""queues.yaml's ``webhooks`` section: which push webhooks the worker accepts, and where
their secrets are.

    webhooks:
      github: {secret_env: STOVEPIPE_GITHUB_WEBHOOK_SECRET}
      gitlab: {token_env: STOVEPIPE_GITLAB_WEBHOOK_TOKEN}

The file names environment variables, never the secrets: a secret is read from the
environment when a delivery arrives (`secret`), so it appears in no file, message or log.
One secret per provider, not per queue: the signature must be checked before the body is
trusted, and the body is what names the repository (and so the queues).

Which queue a push reaches is each queue's business: its source control's repository and
ref (`streams.config.queues.QueuesConfig.watching`), or its ``webhook_repository``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, ValidationError

from streams.schema.fields import Problems, SecretEnvName, Section

Provider = Literal["github", "gitlab"]
PROVIDERS: tuple[Provider, ...] = ("github", "gitlab")

_HOSTED_PATH = re.compile(r"[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)+")


def _hosted_path(value: object) -> str:
    if not isinstance(value, str) or not _HOSTED_PATH.fullmatch(value) or len(value) > 255:
        raise ValueError(f"expected the repository's path as GitHub or GitLab names it "
                         f"(owner/name, group/subgroup/project), e.g. acme/monorepo, got "
                         f"{value!r}")
    return value


HostedPath = Annotated[str, BeforeValidator(_hosted_path)]


class _GitHubFields(Section):
    secret_env: SecretEnvName = Field(examples=["STOVEPIPE_GITHUB_WEBHOOK_SECRET"])


class _GitLabFields(Section):
    token_env: SecretEnvName = Field(examples=["STOVEPIPE_GITLAB_WEBHOOK_TOKEN"])


class WebhooksFields(Section):
    """The ``webhooks`` section: each provider optional; one left out is not accepted."""

    github: _GitHubFields | None = None
    gitlab: _GitLabFields | None = None


@dataclass(frozen=True)
class WebhooksConfig:
    """For each provider, the name of the environment variable holding its secret (the
    GitHub webhook secret, the GitLab secret token); None: that endpoint is not set up."""

    github_secret_env: str | None = None
    gitlab_token_env: str | None = None

    def secret_env(self, provider: Provider) -> str | None:
        return self.github_secret_env if provider == "github" else self.gitlab_token_env

    def secret(self, provider: Provider) -> str | None:
        """The provider's secret from the environment, None when not configured or the
        variable is unset or blank."""
        name = self.secret_env(provider)
        value = os.environ.get(name, "") if name else ""
        return value if value.strip() else None


def load_webhooks(raw: Any, problems: Problems) -> WebhooksConfig:
    """The ``webhooks`` section (none configured for a missing or null one); its problems
    are added to ``problems`` under ``webhooks``."""
    if raw is None:
        return WebhooksConfig()
    try:
        fields = WebhooksFields.model_validate(raw)
    except ValidationError as exc:
        problems.add_validation_error(exc, WebhooksFields, "webhooks")
        return WebhooksConfig()
    return WebhooksConfig(
        github_secret_env=fields.github.secret_env if fields.github else None,
        gitlab_token_env=fields.gitlab.token_env if fields.gitlab else None)
