"""A secured bus for the embedded Apache Kafka: TLS, SASL/SCRAM-SHA-512 principals and ACLs.

    bus = SecuredBus.create(run_dir / "security", principals=["crl-rollout", "crl-archiver"])
    broker = ApacheKafkaBroker(data_dir=run_dir / "kafka", security=bus).start()
    admin = make_admin(bus.client_settings(KafkaSettings(bootstrap_servers=broker.bootstrap_servers), ADMIN))

`SecuredBus.create` makes, once per run directory, everything a secured broker and its clients need, in one folder
only its owner may enter (0700; every file in it 0600 but the CA certificate):

- `ca.pem` / `ca-key.pem`: a certificate authority of the run (EC P-256, `openssl`);
- `broker-keystore.pem`: the broker's private key, its certificate (for 127.0.0.1 and localhost, signed by that CA)
  and the CA, read by Kafka as a PEM keystore (`ssl.keystore.type=PEM`);
- `credentials.json`: a random password for the admin principal, the controller principal and every principal
  asked for (one per worker kind under `crl run`).

The broker (`broker_properties`) serves clients on a `SASL_SSL` listener with SCRAM-SHA-512 only, and authorizes
every request with Kafka's `StandardAuthorizer` (`allow.everyone.if.no.acl.found=false`; the admin principal, which
the broker also uses to talk to itself, and the controller principal are the super users). The controller listener
stays on loopback without TLS: SASL/PLAIN with the controller principal (SCRAM is not available to KRaft controller
listeners, whose credentials would live in the very metadata log they serve).

The SCRAM credentials are written into the metadata log when the storage is formatted (`scram_arguments`): salted
here (PBKDF2-HMAC-SHA512, as Kafka's `ScramFormatter`), so no password appears on the storage tool's command line.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import secrets
import shutil
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from infra.errors import ConfigError

if TYPE_CHECKING:
    from infra.kafka import KafkaSettings

SecurityKind = Literal["none", "sasl_ssl"]

SCRAM_MECHANISM = "SCRAM-SHA-512"
SCRAM_ITERATIONS = 8192
ADMIN = "crl-admin"
"""The admin principal: a super user; the broker's own inter-broker identity and what `crl run` itself uses."""
CONTROLLER = "crl-controller"
"""The principal brokers use on the controller listener (SASL/PLAIN, loopback)."""
AUTHORIZER = "org.apache.kafka.metadata.authorizer.StandardAuthorizer"
CREDENTIALS_FILE = "credentials.json"
CA_FILE = "ca.pem"
CA_KEY_FILE = "ca-key.pem"
KEYSTORE_FILE = "broker-keystore.pem"
CERTIFICATE_DAYS = 825
"""Lifetime of the run's certificates: a run directory may be resumed long after it was made."""


def write_private(path: Path, text: str) -> None:
    """Write `text` into `path`, readable by its owner only from its first byte on."""
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as handle:
        handle.write(text)
    path.chmod(0o600)  # an existing file keeps its mode through O_CREAT


def _owner_only_umask() -> None:
    """Runs in `openssl` before exec: the keys it writes are 0600 from the start."""
    os.umask(0o077)


def _openssl(*args: str, cwd: Path) -> None:
    openssl = shutil.which("openssl")
    if openssl is None:
        raise ConfigError("a secured broker (CRL_BROKER__SECURITY=sasl_ssl) makes its certificates with `openssl`, "
                          "which is not on PATH (Debian: `apt-get install openssl`)")
    result = subprocess.run([openssl, *args], cwd=cwd, capture_output=True, text=True, timeout=60,
                            preexec_fn=_owner_only_umask)
    if result.returncode != 0:
        raise ConfigError(f"`openssl {args[0]}` failed (exit {result.returncode}): {result.stderr.strip()[-500:]}")


def make_certificates(directory: Path) -> None:
    """A CA and a broker certificate for 127.0.0.1 and localhost signed by it, into `directory`."""
    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-noenc"]
    days = ["-days", str(CERTIFICATE_DAYS)]
    _openssl("req", "-x509", *key, "-keyout", CA_KEY_FILE, "-out", CA_FILE, *days, "-subj", "/CN=crl run CA",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
             cwd=directory)
    (directory / "broker.ext").write_text(
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\n"
        "keyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth,clientAuth\n")
    try:
        _openssl("req", *key, "-keyout", "broker-key.pem", "-out", "broker.csr", "-subj", "/CN=localhost",
                 cwd=directory)
        _openssl("x509", "-req", "-in", "broker.csr", "-CA", CA_FILE, "-CAkey", CA_KEY_FILE, "-set_serial",
                 str(secrets.randbits(63)), *days, "-extfile", "broker.ext", "-out", "broker.pem", cwd=directory)
        write_private(directory / KEYSTORE_FILE, "".join(
            (directory / name).read_text() for name in ("broker-key.pem", "broker.pem", CA_FILE)))
    finally:
        for name in ("broker-key.pem", "broker.csr", "broker.pem", "broker.ext"):
            (directory / name).unlink(missing_ok=True)
    (directory / CA_FILE).chmod(0o644)  # public: every client needs it


def salted_scram(password: str, iterations: int = SCRAM_ITERATIONS) -> tuple[bytes, bytes]:
    """(salt, salted password) of SCRAM-SHA-512: PBKDF2-HMAC-SHA512 of the UTF-8 password (RFC 5802's Hi)."""
    salt = secrets.token_bytes(32)
    return salt, hashlib.pbkdf2_hmac("sha512", password.encode(), salt, iterations)


def scram_argument(name: str, password: str) -> str:
    """One `kafka-storage format --add-scram` value, salted: the password itself is not in it."""
    salt, salted = salted_scram(password)
    return (f"{SCRAM_MECHANISM}=[name={name},iterations={SCRAM_ITERATIONS},"
            f"salt=\"{base64.b64encode(salt).decode()}\",saltedpassword=\"{base64.b64encode(salted).decode()}\"]")


def _check_principal(name: str) -> None:
    if not name or not all(c.isalnum() or c in "-_." for c in name):
        raise ConfigError(f"principal name {name!r}: use letters, digits, '-', '_' and '.' only")


@dataclass(frozen=True)
class SecuredBus:
    """The certificates and credentials of one secured broker (see the module docstring)."""

    directory: Path
    passwords: Mapping[str, str]
    """principal -> password; the admin and controller principals included."""

    @property
    def ca_file(self) -> Path:
        return self.directory / CA_FILE

    @property
    def keystore_file(self) -> Path:
        return self.directory / KEYSTORE_FILE

    @property
    def principals(self) -> list[str]:
        """The principals clients may log in as (the controller's is the brokers' own)."""
        return [name for name in self.passwords if name != CONTROLLER]

    @classmethod
    def create(cls, directory: Path, principals: Iterable[str]) -> SecuredBus:
        """The bus of `directory`: made on first use (certificates, a password per principal plus the admin and
        controller ones), read back later. A directory made for other principals is refused: its broker's metadata
        log holds the credentials it was formatted with."""
        wanted = [ADMIN, CONTROLLER, *principals]
        for name in wanted:
            _check_principal(name)
        if len(set(wanted)) != len(wanted):
            raise ConfigError(f"principal names must be distinct from each other and from {ADMIN} and {CONTROLLER}: "
                              f"{wanted}")
        credentials = directory / CREDENTIALS_FILE
        if credentials.exists():
            bus = cls.load(directory)
            if set(bus.passwords) != set(wanted):
                raise ConfigError(f"{directory} holds credentials for {sorted(bus.passwords)}, not {sorted(wanted)}: "
                                  "its broker was formatted for other principals (another set of worker kinds)")
            return bus
        directory.mkdir(parents=True, exist_ok=True)
        directory.chmod(0o700)
        make_certificates(directory)
        passwords = {name: secrets.token_urlsafe(24) for name in wanted}
        write_private(credentials, json.dumps({"mechanism": SCRAM_MECHANISM, "passwords": passwords}, indent=1))
        return cls(directory, passwords)

    @classmethod
    def load(cls, directory: Path) -> SecuredBus:
        path = directory / CREDENTIALS_FILE
        try:
            recorded = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"cannot read the secured broker's credentials {path}: {exc}") from exc
        if path.stat().st_mode & 0o077:
            raise ConfigError(f"{path} may be read by others (mode {path.stat().st_mode & 0o777:o}); it must be 0600")
        missing = [name for name in (CA_FILE, KEYSTORE_FILE) if not (directory / name).is_file()]
        if missing:
            raise ConfigError(f"{directory} lacks {missing}: not a complete secured-broker directory")
        return cls(directory, dict(recorded["passwords"]))

    def password(self, principal: str) -> str:
        try:
            return self.passwords[principal]
        except KeyError:
            raise ConfigError(f"no principal {principal!r} on this broker; there are {self.principals}") from None

    def scram_arguments(self) -> list[str]:
        """`--add-scram ...` for every principal that logs in with SCRAM (all but the controller's)."""
        return [arg for name in self.principals for arg in ("--add-scram", scram_argument(name, self.password(name)))]

    def broker_properties(self, port: int, controller_port: int) -> dict[str, str]:
        """What a secured node adds to (and replaces in) its `server.properties`."""
        controller_password = self.password(CONTROLLER)
        return {
            "listeners": f"SASL_SSL://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller_port}",
            "advertised.listeners": f"SASL_SSL://127.0.0.1:{port}",
            "listener.security.protocol.map": "SASL_SSL:SASL_SSL,CONTROLLER:SASL_PLAINTEXT",
            "inter.broker.listener.name": "SASL_SSL",
            "sasl.enabled.mechanisms": SCRAM_MECHANISM,
            "sasl.mechanism.inter.broker.protocol": SCRAM_MECHANISM,
            "listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config":
                'org.apache.kafka.common.security.scram.ScramLoginModule required '
                f'username="{ADMIN}" password="{self.password(ADMIN)}";',
            "sasl.mechanism.controller.protocol": "PLAIN",
            "listener.name.controller.sasl.enabled.mechanisms": "PLAIN",
            "listener.name.controller.plain.sasl.jaas.config":
                'org.apache.kafka.common.security.plain.PlainLoginModule required '
                f'username="{CONTROLLER}" password="{controller_password}" '
                f'user_{CONTROLLER}="{controller_password}";',
            "ssl.keystore.type": "PEM",
            "ssl.keystore.location": str(self.keystore_file.resolve()),
            "ssl.truststore.type": "PEM",
            "ssl.truststore.location": str(self.ca_file.resolve()),
            "authorizer.class.name": AUTHORIZER,
            "super.users": f"User:{ADMIN};User:{CONTROLLER}",
            "allow.everyone.if.no.acl.found": "false",
        }

    def client_options(self, principal: str = ADMIN) -> dict[str, Any]:
        """kafka-python keywords of a client logged in as `principal`."""
        return {"security_protocol": "SASL_SSL", "sasl_mechanism": SCRAM_MECHANISM,
                "sasl_plain_username": principal, "sasl_plain_password": self.password(principal),
                "ssl_cafile": str(self.ca_file.resolve()), "ssl_check_hostname": True}

    def client_settings(self, kafka: KafkaSettings, principal: str = ADMIN) -> KafkaSettings:
        """`kafka` logged in as `principal` over TLS."""
        return kafka.model_copy(update=self.client_update(principal))

    def client_update(self, principal: str = ADMIN) -> dict[str, Any]:
        from pydantic import SecretStr

        return {"security_protocol": "SASL_SSL", "sasl_mechanism": SCRAM_MECHANISM,
                "sasl_plain_username": principal, "sasl_plain_password": SecretStr(self.password(principal)),
                "ssl_cafile": str(self.ca_file.resolve()), "ssl_check_hostname": True}

    def client_environment(self, principal: str) -> dict[str, str]:
        """`CRL_KAFKA__*` variables that log a `crl` process in as `principal`."""
        return {"CRL_KAFKA__SECURITY_PROTOCOL": "SASL_SSL", "CRL_KAFKA__SASL_MECHANISM": SCRAM_MECHANISM,
                "CRL_KAFKA__SASL_PLAIN_USERNAME": principal,
                "CRL_KAFKA__SASL_PLAIN_PASSWORD": self.password(principal),
                "CRL_KAFKA__SSL_CAFILE": str(self.ca_file.resolve()), "CRL_KAFKA__SSL_CHECK_HOSTNAME": "true"}

    def secrets(self) -> list[str]:
        """Every secret of the bus as text: the passwords and the private keys (for checks that none leaked)."""
        keys = [(self.directory / name).read_text() for name in (CA_KEY_FILE, KEYSTORE_FILE)]
        blocks = [block for text in keys for block in _private_key_blocks(text)]
        return [*self.passwords.values(), *blocks]


def _private_key_blocks(text: str) -> list[str]:
    """The base64 bodies of the private keys in PEM `text`."""
    blocks: list[str] = []
    lines: list[str] = []
    inside = False
    for line in text.splitlines():
        if line.startswith("-----BEGIN") and "PRIVATE KEY" in line:
            inside, lines = True, []
        elif line.startswith("-----END") and inside:
            inside = False
            blocks.append("".join(lines))
        elif inside:
            lines.append(line)
    return blocks


# -- ACLs ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Grant:
    """What one principal may do: read (and describe) `reads`, write (and describe) `writes`, read `groups`."""

    principal: str
    reads: Sequence[str] = ()
    writes: Sequence[str] = ()
    groups: Sequence[str] = ()


def grant_acls(admin: Any, grants: Iterable[Grant]) -> int:
    """Create the ACLs of `grants` (literal topic and group names, any host) with `admin` (a `KafkaAdminClient`
    logged in as a super user). Creating an ACL that exists is a no-op on Kafka, so this may run at every start.
    Returns how many ACLs were asked for; raises `ConfigError` naming the ones the broker refused."""
    from kafka.admin import ACL, ACLOperation, ACLPermissionType, ResourcePattern, ResourceType

    acls = []
    for grant in grants:
        principal = f"User:{grant.principal}"
        wanted = [(ResourceType.TOPIC, name, op) for name in grant.reads
                  for op in (ACLOperation.READ, ACLOperation.DESCRIBE)]
        wanted += [(ResourceType.TOPIC, name, op) for name in grant.writes
                   for op in (ACLOperation.WRITE, ACLOperation.DESCRIBE)]
        wanted += [(ResourceType.GROUP, name, ACLOperation.READ) for name in grant.groups]
        acls += [ACL(principal, "*", operation, ACLPermissionType.ALLOW, ResourcePattern(resource, name))
                 for resource, name, operation in dict.fromkeys(wanted)]
    result = admin.create_acls(acls)
    if result["failed"]:
        raise ConfigError(f"the broker refused {len(result['failed'])} of {len(acls)} ACLs: {result['failed'][:3]}")
    return len(acls)
