"""The OpenAI API over TLS (gateway/tls.py): the real API process started with OPENAI_SSL_* in its environment,
asked by the official `openai` SDK over HTTPS (the CA's certificate verified, and with mutual TLS a client
certificate required), by plain HTTP (refused), and by the launcher's own health check. No tritonserver: the
model list needs none. Certificates are made here (a CA, the server's for 127.0.0.1, a client's)."""

import datetime
import ipaddress
import os
import ssl
import subprocess
import sys
import time
import urllib.request

import openai
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from specdec.gateway import tls
from specdec.serving import healthcheck, launcher
from specdec.serving.server import free_ports

pytestmark = pytest.mark.timeout(120)


def issue(path, name: str, issuer=None, ca: bool = False):
    """A key and certificate for `name` (127.0.0.1 as its address), signed by `issuer` (key, certificate) or
    by itself; written as PATH.key and PATH.pem. Returns (key, certificate, pem path, key path)."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    signer_key, signer = issuer if issuer else (key, None)
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(subject)
               .issuer_name(signer.subject if signer else subject).public_key(key.public_key())
               .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if not ca:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    certificate = builder.sign(signer_key, hashes.SHA256())
    pem, key_path = path.with_suffix(".pem"), path.with_suffix(".key")
    pem.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return key, certificate, pem, key_path


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    root = tmp_path_factory.mktemp("pki")
    ca_key, ca, ca_pem, _ = issue(root / "ca", "test CA", ca=True)
    _, _, server_pem, server_key = issue(root / "server", "specdec", (ca_key, ca))
    _, _, client_pem, client_key = issue(root / "client", "a client", (ca_key, ca))
    _, _, stranger_pem, stranger_key = issue(root / "stranger", "a stranger")  # signed by no CA the server knows
    return {"ca": str(ca_pem), "cert": str(server_pem), "key": str(server_key), "client": (str(client_pem),
            str(client_key)), "stranger": (str(stranger_pem), str(stranger_key))}


def tls_env(pki, cert_reqs: int = 0) -> dict[str, str]:
    env = {tls.ENV["certfile"]: pki["cert"], tls.ENV["keyfile"]: pki["key"], tls.ENV["ca_certs"]: pki["ca"]}
    return {**env, tls.ENV["cert_reqs"]: str(cert_reqs)} if cert_reqs else env


class Api:
    """`python -m specdec.gateway` with `env` added to its environment, on a free port."""

    def __init__(self, env: dict[str, str]):
        self.port = free_ports(1)[0]
        self.process = subprocess.Popen([sys.executable, "-m", "specdec.gateway", "--port", str(self.port),
                                         "--served-model-name", "m", "--grpc-url", "127.0.0.1:1"],
                                        env={**os.environ, **env}, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        while not launcher.accepts(self.port, 0.5):
            assert self.process.poll() is None, self.process.stderr.read()
            assert time.monotonic() < deadline, "the OpenAI API did not start"
            time.sleep(0.1)

    def close(self):
        self.process.terminate()
        self.process.wait(30)


def sdk(port: int, pki, client=None) -> openai.OpenAI:
    context = ssl.create_default_context(cafile=pki["ca"])
    if client:
        context.load_cert_chain(*client)
    return openai.OpenAI(base_url=f"https://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=10,
                         http_client=openai.DefaultHttpxClient(verify=context))


def test_served_over_tls_to_the_sdk_and_not_over_plain_http(pki, monkeypatch):
    api = Api(tls_env(pki))
    try:
        assert [model.id for model in sdk(api.port, pki).models.list().data] == ["m"]
        with pytest.raises(OSError):
            urllib.request.urlopen(f"http://127.0.0.1:{api.port}/v1/models", timeout=5)
        for name, value in tls_env(pki).items():  # as the launcher and the image's HEALTHCHECK see it
            monkeypatch.setenv(name, value)
        assert healthcheck.gateway_url(api.port).startswith(f"https://127.0.0.1:{api.port}/")
        assert healthcheck.answers(f"https://127.0.0.1:{api.port}/v1/models", 5)
    finally:
        api.close()


def test_mutual_tls_requires_a_client_certificate_the_ca_signed(pki, monkeypatch):
    api = Api(tls_env(pki, cert_reqs=2))
    try:
        assert [model.id for model in sdk(api.port, pki, pki["client"]).models.list().data] == ["m"]
        for client in (None, pki["stranger"]):
            with pytest.raises(openai.APIConnectionError):
                sdk(api.port, pki, client).models.list()
        for name, value in tls_env(pki, cert_reqs=2).items():  # the launcher's check presents the server's own
            monkeypatch.setenv(name, value)
        assert healthcheck.answers(f"https://127.0.0.1:{api.port}/v1/models", 5)
    finally:
        api.close()


def test_wrong_tls_settings_are_refused_naming_the_flag_and_its_variable(pki, tmp_path):
    files = tls.TlsFiles(pki["cert"], pki["key"], pki["ca"])
    assert tls.server_context(tls.TlsFiles()) is None
    assert tls.server_context(files).verify_mode == ssl.CERT_NONE
    assert tls.server_context(tls.TlsFiles(pki["cert"], pki["key"], pki["ca"], 1)).verify_mode == ssl.CERT_OPTIONAL
    (garbage := tmp_path / "garbage.pem").write_text("not a certificate")
    cases = {
        tls.TlsFiles(keyfile=pki["key"]): "--ssl-keyfile (OPENAI_SSL_KEYFILE) needs --ssl-certfile",
        tls.TlsFiles(cert_reqs=2): "--ssl-cert-reqs (OPENAI_SSL_CERT_REQS) needs --ssl-certfile",
        tls.TlsFiles(pki["cert"], pki["key"], cert_reqs=2): "2 verifies client certificates: it needs --ssl-ca-certs",
        tls.TlsFiles(pki["cert"], pki["key"], pki["ca"], 5): "must be 0, 1 or 2, not 5",
        tls.TlsFiles(str(tmp_path / "missing.pem")): "--ssl-certfile (OPENAI_SSL_CERTFILE): cannot load",
        tls.TlsFiles(pki["cert"], pki["client"][1]): "--ssl-certfile (OPENAI_SSL_CERTFILE) and --ssl-keyfile",
        tls.TlsFiles(pki["cert"], pki["key"], str(garbage)): "--ssl-ca-certs (OPENAI_SSL_CA_CERTS): cannot load",
    }
    for files, message in cases.items():
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            tls.server_context(files)
    assert tls.from_env({tls.ENV["cert_reqs"]: "two"}).cert_reqs == -1  # refused as above, not a crash


@pytest.mark.usefixtures("server_ports_free")
def test_the_launcher_refuses_wrong_tls_files_before_it_starts_anything(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv(tls.ENV["certfile"], str(tmp_path / "missing.pem"))
    monkeypatch.setattr(launcher.pairs, "prepare_pair", lambda *a, **k: pytest.fail("the pair was prepared"))
    monkeypatch.setattr(launcher.subprocess, "Popen", lambda *a, **k: pytest.fail("a process was started"))
    assert launcher.main(["--run-dir", str(tmp_path)]) == 1
    assert "the OpenAI API: --ssl-certfile (OPENAI_SSL_CERTFILE): cannot load" in capsys.readouterr().err


def test_with_required_client_certificates_the_launcher_checks_that_its_own_probe_gets_in(pki):
    tls.check_probe(tls.TlsFiles(pki["cert"], pki["key"], pki["ca"], 2))  # the CA signed the server's
    tls.check_probe(tls.TlsFiles(*pki["stranger"], pki["ca"], 1))  # nothing to check: none required
    with pytest.raises(ValueError, match="which --ssl-ca-certs .* does not accept"):
        tls.check_probe(tls.TlsFiles(*pki["stranger"], pki["ca"], 2))  # a server certificate the CA did not sign
