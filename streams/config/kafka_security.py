"""How every Kafka client of Stovepipe connects: TLS and SASL from the environment (§12).

One reading of the `STOVEPIPE_KAFKA_*` security variables (`KafkaSecurity.from_env`),
mapped here, and only here, onto each client's own settings:

- confluent-kafka (librdkafka): `librdkafka_conf` — the admin client, the CLI's
  producers and readers, the dashboard's dead-letter depths, the dev stack's probe;
- aiokafka: `aiokafka_conf` — the worker's publisher and delay scheduler, the CLI's
  ingest, the worker's start-up check;
- Faust (over aiokafka): `faust_conf` — the worker's consumer, producer and admin client.

The variables are named after librdkafka's settings (`security.protocol` is
`STOVEPIPE_KAFKA_SECURITY_PROTOCOL`, ...). Invariant: a value that cannot work (an unknown
protocol, SASL without a password, an unreadable CA file, a setting the chosen protocol
ignores) is a `KafkaSecurityError` naming the variable, raised before any client exists;
a broker that refuses us (authentication, TLS) is a `KafkaAccessError` naming the cause
and the variables to check (`streams.config.kafka_access`), never a silent wait.

OAUTHBEARER is supported through OpenID Connect client credentials (librdkafka's
`sasl.oauthbearer.method=oidc`; for aiokafka, `OidcTokenProvider` fetches the same token
from the same endpoint). librdkafka's other OAUTHBEARER paths (a token callback of your
own, unsecured JWTs) and AWS MSK IAM (a mechanism neither client speaks) are not offered.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import ssl
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from aiokafka.abc import AbstractTokenProvider
from aiokafka.errors import (
    KafkaConnectionError,
)

ENV_SECURITY_PROTOCOL = "STOVEPIPE_KAFKA_SECURITY_PROTOCOL"
ENV_SASL_MECHANISM = "STOVEPIPE_KAFKA_SASL_MECHANISM"
ENV_SASL_USERNAME = "STOVEPIPE_KAFKA_SASL_USERNAME"
ENV_SASL_PASSWORD = "STOVEPIPE_KAFKA_SASL_PASSWORD"  # noqa: S105 - a variable's name
ENV_SSL_CA_LOCATION = "STOVEPIPE_KAFKA_SSL_CA_LOCATION"
ENV_SSL_CERTIFICATE_LOCATION = "STOVEPIPE_KAFKA_SSL_CERTIFICATE_LOCATION"
ENV_SSL_KEY_LOCATION = "STOVEPIPE_KAFKA_SSL_KEY_LOCATION"
ENV_SSL_KEY_PASSWORD = "STOVEPIPE_KAFKA_SSL_KEY_PASSWORD"  # noqa: S105 - a variable's name
ENV_SSL_ENDPOINT_IDENTIFICATION = "STOVEPIPE_KAFKA_SSL_ENDPOINT_IDENTIFICATION_ALGORITHM"
ENV_OAUTHBEARER_METHOD = "STOVEPIPE_KAFKA_SASL_OAUTHBEARER_METHOD"
ENV_OAUTHBEARER_CLIENT_ID = "STOVEPIPE_KAFKA_SASL_OAUTHBEARER_CLIENT_ID"
ENV_OAUTHBEARER_CLIENT_SECRET = "STOVEPIPE_KAFKA_SASL_OAUTHBEARER_CLIENT_SECRET"  # noqa: S105
ENV_OAUTHBEARER_TOKEN_ENDPOINT_URL = "STOVEPIPE_KAFKA_SASL_OAUTHBEARER_TOKEN_ENDPOINT_URL"  # noqa: S105
ENV_OAUTHBEARER_SCOPE = "STOVEPIPE_KAFKA_SASL_OAUTHBEARER_SCOPE"
ENV_OAUTHBEARER_EXTENSIONS = "STOVEPIPE_KAFKA_SASL_OAUTHBEARER_EXTENSIONS"

PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER")
ENDPOINT_IDENTIFICATION = ("https", "none")
OAUTHBEARER_METHODS = ("oidc",)

# An OIDC token is fetched again once this share of its lifetime has passed (librdkafka
# refreshes at 80% too), so a connection never presents one about to expire.
TOKEN_REFRESH_AT = 0.8
TOKEN_FETCH_TIMEOUT = 10.0  # seconds for one answer of the token endpoint


class KafkaSecurityError(ValueError):
    """A security variable that cannot work; the message names it and what to do."""


class KafkaAccessError(RuntimeError):
    """The broker refused the connection (authentication, TLS): one line naming the cause
    and the variables to check."""


@dataclass(frozen=True)
class OidcClient:
    """OAuth 2 client credentials (RFC 6749 §4.4) at an OpenID Connect token endpoint."""

    client_id: str
    client_secret: str = field(repr=False)
    token_endpoint_url: str
    scope: str | None = None
    extensions: tuple[tuple[str, str], ...] = ()  # SASL extensions sent with the token


@dataclass(frozen=True)
class KafkaSecurity:
    """The security settings of every Kafka client, validated. The default is PLAINTEXT."""

    protocol: str = "PLAINTEXT"
    mechanism: str | None = None
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    ca_location: str | None = None
    certificate_location: str | None = None
    key_location: str | None = None
    key_password: str | None = field(default=None, repr=False)
    endpoint_identification: str = "https"
    oidc: OidcClient | None = None

    @property
    def uses_tls(self) -> bool:
        return self.protocol in ("SSL", "SASL_SSL")

    @property
    def uses_sasl(self) -> bool:
        return self.protocol in ("SASL_PLAINTEXT", "SASL_SSL")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> KafkaSecurity:
        """The settings the environment asks for; KafkaSecurityError for any that cannot
        work (an empty variable counts as unset)."""
        env = os.environ if environ is None else environ

        def get(name: str) -> str | None:
            value = env.get(name, "").strip()
            return value or None

        protocol = (get(ENV_SECURITY_PROTOCOL) or "PLAINTEXT").upper()
        _one_of(ENV_SECURITY_PROTOCOL, protocol, PROTOCOLS)
        uses_tls, uses_sasl = protocol in ("SSL", "SASL_SSL"), protocol.startswith("SASL_")
        # a credential the protocol would ignore means the connection is not what the
        # operator believes (e.g. a CA given, yet plaintext): refuse it
        if not uses_sasl:
            _unused_by(f"{ENV_SECURITY_PROTOCOL}={protocol}",
                       [n for n in _SASL_VARIABLES if get(n)])
        if not uses_tls:
            _unused_by(f"{ENV_SECURITY_PROTOCOL}={protocol}",
                       [n for n in _TLS_VARIABLES if get(n)])

        mechanism = None
        if uses_sasl:
            mechanism = (get(ENV_SASL_MECHANISM) or "").upper() or None
            if mechanism is None:
                raise KafkaSecurityError(
                    f"{ENV_SECURITY_PROTOCOL}={protocol} needs {ENV_SASL_MECHANISM} (one of "
                    f"{', '.join(MECHANISMS)})")
            _one_of(ENV_SASL_MECHANISM, mechanism, MECHANISMS)
        username, password, oidc = get(ENV_SASL_USERNAME), get(ENV_SASL_PASSWORD), None
        if mechanism == "OAUTHBEARER":
            _unused_by(f"{ENV_SASL_MECHANISM}=OAUTHBEARER",
                       [n for n in (ENV_SASL_USERNAME, ENV_SASL_PASSWORD) if get(n)])
            oidc = _oidc_client(get)
        elif mechanism is not None:
            for name, value in ((ENV_SASL_USERNAME, username), (ENV_SASL_PASSWORD, password)):
                if value is None:
                    raise KafkaSecurityError(
                        f"{ENV_SASL_MECHANISM}={mechanism} needs {name}; it is not set")
            _unused_by(f"{ENV_SASL_MECHANISM}={mechanism}",
                       [n for n in _OAUTHBEARER_VARIABLES if get(n)])

        ca, cert, key = (get(ENV_SSL_CA_LOCATION), get(ENV_SSL_CERTIFICATE_LOCATION),
                         get(ENV_SSL_KEY_LOCATION))
        for name, path in ((ENV_SSL_CA_LOCATION, ca), (ENV_SSL_CERTIFICATE_LOCATION, cert),
                           (ENV_SSL_KEY_LOCATION, key)):
            if path is not None:
                _readable(name, path)
        if (cert is None) != (key is None):
            given, missing = ((ENV_SSL_CERTIFICATE_LOCATION, ENV_SSL_KEY_LOCATION) if key is None
                              else (ENV_SSL_KEY_LOCATION, ENV_SSL_CERTIFICATE_LOCATION))
            raise KafkaSecurityError(
                f"{given} is set but {missing} is not: a client certificate needs both")
        key_password = get(ENV_SSL_KEY_PASSWORD)
        if key_password is not None and key is None:
            raise KafkaSecurityError(
                f"{ENV_SSL_KEY_PASSWORD} is set but {ENV_SSL_KEY_LOCATION} is not")
        identification = (get(ENV_SSL_ENDPOINT_IDENTIFICATION) or "https").lower()
        _one_of(ENV_SSL_ENDPOINT_IDENTIFICATION, identification, ENDPOINT_IDENTIFICATION)

        security = cls(protocol=protocol, mechanism=mechanism, username=username,
                       password=password, ca_location=ca, certificate_location=cert,
                       key_location=key, key_password=key_password,
                       endpoint_identification=identification, oidc=oidc)
        if uses_tls:
            security.ssl_context()  # a CA or key that does not load fails now, by name
        return security

    # --- each client's settings ------------------------------------------------------

    def librdkafka(self) -> dict[str, Any]:
        """confluent-kafka's settings (`security.protocol`, `sasl.*`, `ssl.*`)."""
        conf: dict[str, Any] = {"security.protocol": self.protocol}
        if self.uses_sasl:
            conf["sasl.mechanism"] = self.mechanism
        if self.oidc is not None:
            conf.update({
                "sasl.oauthbearer.method": "oidc",
                "sasl.oauthbearer.client.id": self.oidc.client_id,
                "sasl.oauthbearer.client.secret": self.oidc.client_secret,
                "sasl.oauthbearer.token.endpoint.url": self.oidc.token_endpoint_url,
            })
            if self.oidc.scope:
                conf["sasl.oauthbearer.scope"] = self.oidc.scope
            if self.oidc.extensions:
                conf["sasl.oauthbearer.extensions"] = ",".join(
                    f"{k}={v}" for k, v in self.oidc.extensions)
        elif self.uses_sasl:
            conf["sasl.username"] = self.username
            conf["sasl.password"] = self.password
        if self.uses_tls:
            conf["ssl.endpoint.identification.algorithm"] = self.endpoint_identification
            for key, value in (("ssl.ca.location", self.ca_location),
                               ("ssl.certificate.location", self.certificate_location),
                               ("ssl.key.location", self.key_location),
                               ("ssl.key.password", self.key_password)):
                if value is not None:
                    conf[key] = value
        return conf

    def ssl_context(self) -> ssl.SSLContext:
        """The TLS context of the aiokafka clients: the CA (else the system's), the client
        certificate, and hostname checking unless endpoint identification is `none` (the
        certificate chain is verified either way, as librdkafka does)."""
        try:
            context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH,
                                                 cafile=self.ca_location)
        except (ssl.SSLError, OSError) as exc:
            raise KafkaSecurityError(
                f"{ENV_SSL_CA_LOCATION}={self.ca_location} holds no usable CA certificate "
                f"({_ssl_reason(exc)}): give a PEM file of CA certificates") from None
        context.check_hostname = self.endpoint_identification == "https"
        if self.certificate_location is not None and self.key_location is not None:
            try:
                context.load_cert_chain(self.certificate_location, self.key_location,
                                        password=self.key_password)
            except (ssl.SSLError, OSError) as exc:
                raise KafkaSecurityError(
                    f"the client certificate {ENV_SSL_CERTIFICATE_LOCATION}="
                    f"{self.certificate_location} with {ENV_SSL_KEY_LOCATION}="
                    f"{self.key_location} does not load ({_ssl_reason(exc)}): PEM files of a "
                    f"certificate and its key, and {ENV_SSL_KEY_PASSWORD} when the key is "
                    f"encrypted") from None
        return context

    def aiokafka(self) -> dict[str, Any]:
        """aiokafka's settings (`security_protocol`, `ssl_context`, `sasl_*`)."""
        conf: dict[str, Any] = {"security_protocol": self.protocol}
        if self.uses_tls:
            conf["ssl_context"] = self.ssl_context()
        if self.uses_sasl:
            conf["sasl_mechanism"] = self.mechanism
        if self.oidc is not None:
            conf["sasl_oauth_token_provider"] = OidcTokenProvider(self.oidc)
        elif self.uses_sasl:
            # aiokafka's names; they carry SCRAM's credentials too
            conf["sasl_plain_username"] = self.username
            conf["sasl_plain_password"] = self.password
        return conf

    def faust_credentials(self) -> Any:
        """Faust's `broker_credentials` (its consumer, producer and admin client), or None
        for PLAINTEXT. Faust makes SASL_SSL of SASL credentials that carry a TLS context."""
        from faust.auth import OAuthCredentials, SASLCredentials, SSLCredentials

        if self.protocol == "PLAINTEXT":
            return None
        context = self.ssl_context() if self.uses_tls else None
        if self.protocol == "SSL":
            return SSLCredentials(context)
        if self.oidc is not None:
            return OAuthCredentials(oauth_cb=OidcTokenProvider(self.oidc), ssl_context=context)
        return SASLCredentials(username=self.username, password=self.password,
                               ssl_context=context, mechanism=self.mechanism)

    # --- naming what to check ---------------------------------------------------------

    def who(self) -> str:
        """How we present ourselves, for messages (never a secret)."""
        if self.oidc is not None:
            return f"OAUTHBEARER client {self.oidc.client_id!r}"
        if self.uses_sasl:
            return f"{self.mechanism} user {self.username!r}"
        if self.certificate_location:
            return f"client certificate {self.certificate_location}"
        return "no credentials"

    def credential_variables(self) -> str:
        if self.oidc is not None:
            return (f"{ENV_OAUTHBEARER_CLIENT_ID}, {ENV_OAUTHBEARER_CLIENT_SECRET} and "
                    f"{ENV_OAUTHBEARER_TOKEN_ENDPOINT_URL}")
        if self.uses_sasl:
            return f"{ENV_SASL_USERNAME} and {ENV_SASL_PASSWORD}"
        return f"{ENV_SSL_CERTIFICATE_LOCATION} and {ENV_SSL_KEY_LOCATION}"


_SASL_VARIABLES = (ENV_SASL_MECHANISM, ENV_SASL_USERNAME, ENV_SASL_PASSWORD,
                   ENV_OAUTHBEARER_METHOD, ENV_OAUTHBEARER_CLIENT_ID,
                   ENV_OAUTHBEARER_CLIENT_SECRET, ENV_OAUTHBEARER_TOKEN_ENDPOINT_URL,
                   ENV_OAUTHBEARER_SCOPE, ENV_OAUTHBEARER_EXTENSIONS)
_OAUTHBEARER_VARIABLES = _SASL_VARIABLES[3:]
# (endpoint identification is left out: it has a default, and a chart may always set it)
_TLS_VARIABLES = (ENV_SSL_CA_LOCATION, ENV_SSL_CERTIFICATE_LOCATION, ENV_SSL_KEY_LOCATION,
                  ENV_SSL_KEY_PASSWORD)


def _one_of(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise KafkaSecurityError(f"{name}={value!r} is not one of {', '.join(allowed)}")


def _unused_by(what: str, names: list[str]) -> None:
    """A variable the chosen protocol or mechanism would silently ignore is a mistake."""
    if names:
        raise KafkaSecurityError(f"{names[0]} is set but {what} does not use it: unset it, "
                                 f"or choose a protocol or mechanism that does")


def _readable(name: str, path: str) -> None:
    try:
        with open(path, "rb") as file:
            file.read(1)
    except OSError as exc:
        raise KafkaSecurityError(
            f"{name}={path} cannot be read ({exc.strerror or exc})") from None


def _oidc_client(get: Any) -> OidcClient:
    method = (get(ENV_OAUTHBEARER_METHOD) or "oidc").lower()
    if method not in OAUTHBEARER_METHODS:
        raise KafkaSecurityError(
            f"{ENV_OAUTHBEARER_METHOD}={method!r} is not supported: Stovepipe's clients share "
            f"OAUTHBEARER only through OpenID Connect client credentials (oidc)")
    values = {}
    for name in (ENV_OAUTHBEARER_CLIENT_ID, ENV_OAUTHBEARER_CLIENT_SECRET,
                 ENV_OAUTHBEARER_TOKEN_ENDPOINT_URL):
        value = get(name)
        if value is None:
            raise KafkaSecurityError(f"{ENV_SASL_MECHANISM}=OAUTHBEARER needs {name}; it is "
                                     f"not set")
        values[name] = value
    url = values[ENV_OAUTHBEARER_TOKEN_ENDPOINT_URL]
    if not url.startswith(("https://", "http://")):
        raise KafkaSecurityError(f"{ENV_OAUTHBEARER_TOKEN_ENDPOINT_URL}={url!r} is not an "
                                 f"http(s) URL")
    extensions = []
    for pair in filter(None, (p.strip() for p in (get(ENV_OAUTHBEARER_EXTENSIONS) or "")
                              .split(","))):
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise KafkaSecurityError(f"{ENV_OAUTHBEARER_EXTENSIONS}: {pair!r} is not "
                                     f"key=value (pairs separated by commas)")
        extensions.append((key.strip(), value.strip()))
    return OidcClient(values[ENV_OAUTHBEARER_CLIENT_ID], values[ENV_OAUTHBEARER_CLIENT_SECRET],
                      url, get(ENV_OAUTHBEARER_SCOPE), tuple(extensions))


def _ssl_reason(exc: BaseException) -> str:
    if isinstance(exc, ssl.SSLError) and exc.reason:
        return str(exc.reason).replace("_", " ").lower()
    return getattr(exc, "strerror", None) or str(exc) or type(exc).__name__


# --- the settings of one client, for a bootstrap -------------------------------------------


def librdkafka_conf(bootstrap: str, security: KafkaSecurity | None = None,
                    **extra: Any) -> dict[str, Any]:
    """A confluent-kafka configuration for `bootstrap` with the environment's security
    (or `security`), then `extra`."""
    security = security or KafkaSecurity.from_env()
    return {"bootstrap.servers": bootstrap, **security.librdkafka(), **extra}


def aiokafka_conf(bootstrap: str, security: KafkaSecurity | None = None) -> dict[str, Any]:
    """The keyword arguments every aiokafka client gets for `bootstrap`."""
    security = security or KafkaSecurity.from_env()
    return {"bootstrap_servers": bootstrap_list(bootstrap), **security.aiokafka()}


def faust_conf(bootstrap: str, security: KafkaSecurity | None = None) -> dict[str, Any]:
    """Faust's `broker` (one URL per bootstrap server: Faust separates them with `;`) and
    `broker_credentials`."""
    security = security or KafkaSecurity.from_env()
    conf: dict[str, Any] = {
        "broker": ";".join(f"kafka://{server}" for server in bootstrap_list(bootstrap))}
    credentials = security.faust_credentials()
    if credentials is not None:
        conf["broker_credentials"] = credentials
    return conf


def bootstrap_list(bootstrap: str) -> list[str]:
    """`host:port,host:port` (librdkafka's form) as a list (aiokafka's and Faust's)."""
    return [s.strip() for s in bootstrap.split(",") if s.strip()]


# --- OAUTHBEARER through OpenID Connect, for aiokafka ---------------------------------------


class OidcTokenError(KafkaConnectionError):
    """No token from the OIDC token endpoint (a KafkaConnectionError, so aiokafka treats
    it as a failed connection and our access check names it)."""


class OidcTokenProvider(AbstractTokenProvider):
    """aiokafka's token provider for OAUTHBEARER: what librdkafka's `oidc` method does —
    a client-credentials grant at the token endpoint (client id and secret in HTTP Basic
    authentication), the access token reused until `TOKEN_REFRESH_AT` of its lifetime.
    A refused or failed fetch raises `OidcTokenError`, which aiokafka reports as a failed
    connection."""

    def __init__(self, client: OidcClient) -> None:
        self.client = client
        self._token: str | None = None
        self._renew_at = 0.0
        # the token and its renewal time change together: Faust's consumer, on a thread of
        # its own, shares this provider with the producer
        self._lock = threading.Lock()

    async def token(self) -> str:
        if self._token is not None and time.monotonic() < self._renew_at:
            return self._token
        token, lifetime = await asyncio.to_thread(self._fetch)
        with self._lock:
            self._token = token
            self._renew_at = time.monotonic() + lifetime * TOKEN_REFRESH_AT
        return token

    def extensions(self) -> dict[str, str]:
        return dict(self.client.extensions)

    def _fetch(self) -> tuple[str, float]:
        """(access token, lifetime in seconds) from the token endpoint; blocking."""
        import urllib.error
        import urllib.parse
        import urllib.request

        form = {"grant_type": "client_credentials"}
        if self.client.scope:
            form["scope"] = self.client.scope
        basic = base64.b64encode(
            f"{urllib.parse.quote(self.client.client_id)}:"
            f"{urllib.parse.quote(self.client.client_secret)}".encode()).decode()
        request = urllib.request.Request(  # noqa: S310 - an http(s) URL, checked at start
            self.client.token_endpoint_url, data=urllib.parse.urlencode(form).encode(),
            headers={"Authorization": f"Basic {basic}", "Accept": "application/json",
                     "Content-Type": "application/x-www-form-urlencoded"})
        url = self.client.token_endpoint_url
        try:
            with urllib.request.urlopen(request, timeout=TOKEN_FETCH_TIMEOUT) as answer:  # noqa: S310
                body = json.loads(answer.read())
        except urllib.error.HTTPError as exc:
            exc.close()  # an error answer is a response too: its socket
            raise OidcTokenError(f"the OAUTHBEARER token endpoint {url} refused client "
                                 f"{self.client.client_id!r}: HTTP {exc.code}") from None
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise OidcTokenError(f"no token from the OAUTHBEARER token endpoint {url} "
                                 f"({getattr(exc, 'reason', None) or exc})") from None
        token = body.get("access_token") if isinstance(body, dict) else None
        if not isinstance(token, str) or not token:
            raise OidcTokenError(f"the OAUTHBEARER token endpoint {url} answered without an "
                                 f"access_token")
        expires_in = body.get("expires_in")
        lifetime = float(expires_in) if isinstance(expires_in, int | float) else 300.0
        return token, max(lifetime, 1.0)
