"""The secure dev stack's secrets: a CA of its own, the certificates it signs, passwords.

`stovepipe dev up --secure` gives the broker a SASL_SSL and a mutual-TLS listener and
PostgreSQL TLS, all with certificates of one local CA, so a client configured like a
production one (`STOVEPIPE_KAFKA_SSL_CA_LOCATION`, `sslmode=verify-full`) works against
it. Made once with `openssl` under `<home>/dev/secure/` (files of mode 0600) and reused:

    ca.pem, ca.key                the CA (clients trust ca.pem)
    server.pem, server.key        the server certificate (localhost, 127.0.0.1, ::1)
    kafka-keystore.pem            server.key + server.pem, the broker's PEM keystore
    client.pem, client.key        a client certificate (CN=stovepipe); the key encrypted
    client-key-password           ... with this password
    kafka-password                the SASL password of the user `stovepipe`

A dev convenience: these certificates are for loopback only, and the CA key lies beside
them.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from streams.config.settings import Settings

from .common import DevStackError, write_text_atomic

KAFKA_USER = "stovepipe"
CA_DAYS = 3650
CERT_DAYS = 825
SUBJECT_NAMES = "DNS:localhost,IP:127.0.0.1,IP:::1"
_INSTALL_OPENSSL = "apt-get update && apt-get install -y openssl"


@dataclass(frozen=True)
class DevSecrets:
    root: Path

    @property
    def ca(self) -> Path:
        return self.root / "ca.pem"

    @property
    def ca_key(self) -> Path:
        return self.root / "ca.key"

    @property
    def server_cert(self) -> Path:
        return self.root / "server.pem"

    @property
    def server_key(self) -> Path:
        return self.root / "server.key"

    @property
    def kafka_keystore(self) -> Path:
        return self.root / "kafka-keystore.pem"

    @property
    def client_cert(self) -> Path:
        return self.root / "client.pem"

    @property
    def client_key(self) -> Path:
        return self.root / "client.key"

    @property
    def client_key_password_file(self) -> Path:
        return self.root / "client-key-password"

    @property
    def kafka_password_file(self) -> Path:
        return self.root / "kafka-password"

    @property
    def complete(self) -> Path:
        return self.root / ".complete"

    def kafka_password(self) -> str:
        return self.kafka_password_file.read_text().strip()

    def client_key_password(self) -> str:
        return self.client_key_password_file.read_text().strip()


def dev_secrets(settings: Settings) -> DevSecrets:
    return DevSecrets(settings.home / "dev" / "secure")


def ensure_secrets(settings: Settings) -> DevSecrets:
    """The dev stack's CA, certificates and passwords, made on first use."""
    found = dev_secrets(settings)
    if found.complete.is_file():
        return found
    openssl = shutil.which("openssl")
    if openssl is None:
        raise DevStackError(f"`openssl` is not installed; the secure dev stack makes its "
                            f"certificates with it. Install it: {_INSTALL_OPENSSL}")
    shutil.rmtree(found.root, ignore_errors=True)  # an interrupted run: nothing to keep
    found.root.mkdir(parents=True, mode=0o700)
    os.chmod(found.root, 0o700)
    _make(openssl, found)
    write_text_atomic(found.complete, "")
    return found


def _make(openssl: str, out: DevSecrets) -> None:
    def run(*args: str) -> None:
        done = subprocess.run([openssl, *args], cwd=out.root, capture_output=True, text=True,
                              timeout=60, check=False, stdin=subprocess.DEVNULL)
        if done.returncode != 0:
            raise DevStackError(f"`openssl {' '.join(args)}` failed (exit {done.returncode}):"
                                f"\n{(done.stdout + done.stderr).strip()}")

    key_password = secrets.token_urlsafe(18)
    _secret(out.client_key_password_file, key_password + "\n")
    _secret(out.kafka_password_file, secrets.token_urlsafe(18) + "\n")
    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem",
        "-days", str(CA_DAYS), "-subj", "/CN=Stovepipe dev CA",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    for name, usage, subject in (("server", "serverAuth", "/CN=localhost"),
                                 ("client", "clientAuth", f"/CN={KAFKA_USER}")):
        extensions = out.root / f"{name}.ext"
        extensions.write_text(
            "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
            f"extendedKeyUsage={usage}\n"
            + (f"subjectAltName={SUBJECT_NAMES}\n" if name == "server" else ""))
        run("req", "-new", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key",
            "-out", f"{name}.csr", "-subj", subject)
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", f"{name}.pem", "-days", str(CERT_DAYS),
            "-extfile", extensions.name)
        (out.root / f"{name}.csr").unlink()
        extensions.unlink()
    # the client's key encrypted (PKCS#8), so STOVEPIPE_KAFKA_SSL_KEY_PASSWORD is exercised
    run("pkcs8", "-topk8", "-v2", "aes-256-cbc", "-in", "client.key", "-out", "client.key.enc",
        "-passout", f"file:{out.client_key_password_file.name}")
    (out.root / "client.key.enc").replace(out.client_key)
    _secret(out.kafka_keystore, out.server_key.read_text() + out.server_cert.read_text())
    for path in out.root.iterdir():
        path.chmod(0o600)


def _secret(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(0o600)
