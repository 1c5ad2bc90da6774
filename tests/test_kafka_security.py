"""The Kafka security variables: what each client is handed, and every value that cannot
work refused at start with one line naming the variable (no broker needed).

The same settings against a real SASL_SSL and mutual-TLS broker: test_secure_kafka.
"""

from __future__ import annotations

import os
import ssl
import subprocess
import sys
import time
from pathlib import Path

import pytest

from streams.config import kafka_security as ks
from streams.config.settings import REPO_ROOT
from tests.stack_support import free_ports

STOVEPIPE = [sys.executable, "-m", "streams.cli"]


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA and a client certificate whose key is encrypted with the password `pw`."""
    root = tmp_path_factory.mktemp("pki")

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=root, check=True, capture_output=True,
                       timeout=60)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out",
            "ca.pem", "-days", "2", "-subj", "/CN=Test CA")
    openssl("req", "-new", "-newkey", "rsa:2048", "-nodes", "-keyout", "plain.key", "-out",
            "client.csr", "-subj", "/CN=client")
    openssl("x509", "-req", "-in", "client.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", "client.pem", "-days", "2")
    openssl("pkcs8", "-topk8", "-v2", "aes-256-cbc", "-in", "plain.key", "-out", "client.key",
            "-passout", "pass:pw")
    (root / "garbage.pem").write_text("not a certificate\n")
    return root


SCRAM = {ks.ENV_SECURITY_PROTOCOL: "SASL_SSL", ks.ENV_SASL_MECHANISM: "SCRAM-SHA-512",
         ks.ENV_SASL_USERNAME: "svc", ks.ENV_SASL_PASSWORD: "p4ss"}


def test_plaintext_by_default() -> None:
    security = ks.KafkaSecurity.from_env({})
    assert security.librdkafka() == {"security.protocol": "PLAINTEXT"}
    assert security.aiokafka() == {"security_protocol": "PLAINTEXT"}
    assert security.faust_credentials() is None
    assert ks.faust_conf("a:1", security) == {"broker": "kafka://a:1"}


def test_sasl_ssl_with_scram_for_every_client(pki: Path) -> None:
    security = ks.KafkaSecurity.from_env(
        {**SCRAM, ks.ENV_SSL_CA_LOCATION: str(pki / "ca.pem"),
         ks.ENV_SECURITY_PROTOCOL: "sasl_ssl", ks.ENV_SASL_MECHANISM: "scram-sha-512"})
    assert ks.librdkafka_conf("b1:9096,b2:9096", security, **{"group.id": "g"}) == {
        "bootstrap.servers": "b1:9096,b2:9096", "security.protocol": "SASL_SSL",
        "sasl.mechanism": "SCRAM-SHA-512", "sasl.username": "svc", "sasl.password": "p4ss",
        "ssl.ca.location": str(pki / "ca.pem"),
        "ssl.endpoint.identification.algorithm": "https", "group.id": "g"}
    aio = ks.aiokafka_conf("b1:9096,b2:9096", security)
    context = aio.pop("ssl_context")
    assert aio == {"bootstrap_servers": ["b1:9096", "b2:9096"],
                   "security_protocol": "SASL_SSL", "sasl_mechanism": "SCRAM-SHA-512",
                   "sasl_plain_username": "svc", "sasl_plain_password": "p4ss"}
    assert isinstance(context, ssl.SSLContext) and context.check_hostname
    assert context.verify_mode is ssl.CERT_REQUIRED
    faust = ks.faust_conf("b1:9096,b2:9096", security)
    # one URL per server: Faust splits its broker setting on ';', never on ','
    assert faust["broker"] == "kafka://b1:9096;kafka://b2:9096"
    from faust.transport.drivers.aiokafka import credentials_to_aiokafka_auth

    auth = credentials_to_aiokafka_auth(faust["broker_credentials"])
    assert isinstance(auth.pop("ssl_context"), ssl.SSLContext)
    assert auth == {"security_protocol": "SASL_SSL", "sasl_mechanism": "SCRAM-SHA-512",
                    "sasl_plain_username": "svc", "sasl_plain_password": "p4ss"}
    assert "p4ss" not in repr(security)


def test_mutual_tls_with_an_encrypted_key(pki: Path) -> None:
    security = ks.KafkaSecurity.from_env({
        ks.ENV_SECURITY_PROTOCOL: "SSL", ks.ENV_SSL_CA_LOCATION: str(pki / "ca.pem"),
        ks.ENV_SSL_CERTIFICATE_LOCATION: str(pki / "client.pem"),
        ks.ENV_SSL_KEY_LOCATION: str(pki / "client.key"), ks.ENV_SSL_KEY_PASSWORD: "pw",
        ks.ENV_SSL_ENDPOINT_IDENTIFICATION: "none"})
    assert security.librdkafka() == {
        "security.protocol": "SSL", "ssl.endpoint.identification.algorithm": "none",
        "ssl.ca.location": str(pki / "ca.pem"),
        "ssl.certificate.location": str(pki / "client.pem"),
        "ssl.key.location": str(pki / "client.key"), "ssl.key.password": "pw"}
    context = security.aiokafka()["ssl_context"]
    assert not context.check_hostname and context.verify_mode is ssl.CERT_REQUIRED
    from faust.transport.drivers.aiokafka import credentials_to_aiokafka_auth

    auth = credentials_to_aiokafka_auth(security.faust_credentials())
    assert auth["security_protocol"] == "SSL" and isinstance(auth["ssl_context"],
                                                              ssl.SSLContext)


def test_oauthbearer_through_oidc_for_both_clients() -> None:
    security = ks.KafkaSecurity.from_env({
        ks.ENV_SECURITY_PROTOCOL: "SASL_SSL", ks.ENV_SASL_MECHANISM: "OAUTHBEARER",
        ks.ENV_OAUTHBEARER_CLIENT_ID: "cid", ks.ENV_OAUTHBEARER_CLIENT_SECRET: "sec",
        ks.ENV_OAUTHBEARER_TOKEN_ENDPOINT_URL: "https://idp.example/token",
        ks.ENV_OAUTHBEARER_SCOPE: "kafka", ks.ENV_OAUTHBEARER_EXTENSIONS: "logicalCluster=lkc-1"})
    assert security.librdkafka() == {
        "security.protocol": "SASL_SSL", "sasl.mechanism": "OAUTHBEARER",
        "sasl.oauthbearer.method": "oidc", "sasl.oauthbearer.client.id": "cid",
        "sasl.oauthbearer.client.secret": "sec",
        "sasl.oauthbearer.token.endpoint.url": "https://idp.example/token",
        "sasl.oauthbearer.scope": "kafka",
        "sasl.oauthbearer.extensions": "logicalCluster=lkc-1",
        "ssl.endpoint.identification.algorithm": "https"}
    provider = security.aiokafka()["sasl_oauth_token_provider"]
    from aiokafka.abc import AbstractTokenProvider

    assert isinstance(provider, AbstractTokenProvider)
    assert provider.extensions() == {"logicalCluster": "lkc-1"}


@pytest.mark.parametrize(("env", "names"), [
    ({ks.ENV_SECURITY_PROTOCOL: "TLS"}, [ks.ENV_SECURITY_PROTOCOL, "'TLS'", "SASL_SSL"]),
    ({ks.ENV_SECURITY_PROTOCOL: "SASL_SSL"}, [ks.ENV_SASL_MECHANISM, "SCRAM-SHA-512"]),
    ({**SCRAM, ks.ENV_SASL_MECHANISM: "GSSAPI"}, [ks.ENV_SASL_MECHANISM, "'GSSAPI'"]),
    ({**SCRAM, ks.ENV_SASL_PASSWORD: ""}, [ks.ENV_SASL_PASSWORD, "SCRAM-SHA-512"]),
    ({**SCRAM, ks.ENV_SASL_USERNAME: " "}, [ks.ENV_SASL_USERNAME]),
    ({**SCRAM, ks.ENV_SSL_CA_LOCATION: "/nonexistent/ca.pem"},
     [ks.ENV_SSL_CA_LOCATION, "/nonexistent/ca.pem", "No such file"]),
    ({ks.ENV_SASL_USERNAME: "svc"}, [ks.ENV_SASL_USERNAME, "PLAINTEXT"]),
    ({**SCRAM, ks.ENV_SECURITY_PROTOCOL: "SASL_PLAINTEXT", ks.ENV_SSL_CA_LOCATION: "/x"},
     [ks.ENV_SSL_CA_LOCATION, "SASL_PLAINTEXT"]),
    ({ks.ENV_SECURITY_PROTOCOL: "SSL", ks.ENV_SSL_ENDPOINT_IDENTIFICATION: "strict"},
     [ks.ENV_SSL_ENDPOINT_IDENTIFICATION, "https, none"]),
    ({ks.ENV_SECURITY_PROTOCOL: "SASL_SSL", ks.ENV_SASL_MECHANISM: "OAUTHBEARER",
      ks.ENV_OAUTHBEARER_CLIENT_ID: "c", ks.ENV_OAUTHBEARER_CLIENT_SECRET: "s"},
     [ks.ENV_OAUTHBEARER_TOKEN_ENDPOINT_URL]),
    ({ks.ENV_SECURITY_PROTOCOL: "SASL_SSL", ks.ENV_SASL_MECHANISM: "OAUTHBEARER",
      ks.ENV_OAUTHBEARER_METHOD: "default"}, [ks.ENV_OAUTHBEARER_METHOD, "oidc"]),
    ({**SCRAM, ks.ENV_OAUTHBEARER_CLIENT_ID: "c"}, [ks.ENV_OAUTHBEARER_CLIENT_ID]),
])
def test_a_value_that_cannot_work_is_named(env: dict[str, str], names: list[str]) -> None:
    with pytest.raises(ks.KafkaSecurityError) as raised:
        ks.KafkaSecurity.from_env(env)
    message = str(raised.value)
    assert "\n" not in message
    for name in names:
        assert name in message


def test_certificates_that_do_not_load_are_named(pki: Path) -> None:
    tls = {ks.ENV_SECURITY_PROTOCOL: "SSL"}
    cases = [
        ({ks.ENV_SSL_CA_LOCATION: str(pki / "garbage.pem")}, ks.ENV_SSL_CA_LOCATION),
        ({ks.ENV_SSL_CERTIFICATE_LOCATION: str(pki / "client.pem")}, ks.ENV_SSL_KEY_LOCATION),
        ({ks.ENV_SSL_CERTIFICATE_LOCATION: str(pki / "client.pem"),
          ks.ENV_SSL_KEY_LOCATION: str(pki / "client.key"), ks.ENV_SSL_KEY_PASSWORD: "wrong"},
         ks.ENV_SSL_KEY_PASSWORD),
        ({ks.ENV_SSL_KEY_PASSWORD: "pw"}, ks.ENV_SSL_KEY_LOCATION),
    ]
    for env, name in cases:
        with pytest.raises(ks.KafkaSecurityError, match=name):
            ks.KafkaSecurity.from_env({**tls, **env})


@pytest.mark.parametrize("args", [("worker",), ("topics", "verify"), ("ingest", "demo/main"),
                                  ("dlq", "list", "process"), ("dev", "status")])
def test_every_command_names_a_bad_variable_at_start(args: tuple[str, ...],
                                                     tmp_path: Path) -> None:
    dead = free_ports(1)[0]
    env = dict(os.environ, STOVEPIPE_HOME=str(tmp_path),
               STOVEPIPE_KAFKA_BOOTSTRAP=f"127.0.0.1:{dead}",
               STOVEPIPE_POSTGRES_DSN=f"postgresql://stovepipe@127.0.0.1:{dead}/stovepipe",
               **{ks.ENV_SECURITY_PROTOCOL: "SASL_SSL", ks.ENV_SASL_MECHANISM: "PLAIN",
                  ks.ENV_SASL_USERNAME: "svc"})
    started = time.monotonic()
    out = subprocess.run([*STOVEPIPE, *args], env=env, capture_output=True, text=True,
                         timeout=60, cwd=REPO_ROOT)
    assert out.returncode == 1, out
    assert "Traceback" not in out.stderr, out.stderr
    said = out.stdout + out.stderr
    assert f"{ks.ENV_SASL_MECHANISM}=PLAIN needs {ks.ENV_SASL_PASSWORD}" in said, said
    assert time.monotonic() - started < 30
