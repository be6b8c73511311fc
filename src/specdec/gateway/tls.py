"""The OpenAI API over TLS: vLLM's flags (--ssl-certfile, --ssl-keyfile, --ssl-ca-certs, --ssl-cert-reqs),
which default to OPENAI_SSL_CERTFILE, OPENAI_SSL_KEYFILE, OPENAI_SSL_CA_CERTS and OPENAI_SSL_CERT_REQS: the
launcher, its health checks and the image's HEALTHCHECK read the same variables (as they read OPENAI_PORT),
so one setting turns TLS on for the API and for everything that asks it whether it is up.

--ssl-cert-reqs is Python's `ssl.VerifyMode` as vLLM (uvicorn) takes it: 0 no client certificate asked for,
1 one verified if given, 2 one required (mutual TLS); 1 and 2 verify against --ssl-ca-certs. The launcher's
own checks run over the loopback and do not verify the server (its certificate names the service, not
127.0.0.1); where client certificates are required they present the server's own, which the CA must accept
(`check_probe`, run by the launcher at start)."""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass
from typing import Mapping

# The address the API listens on (vLLM's and SGLang's --host; unset: every interface), beside its TLS settings:
# the launcher's health checks read it too (serving/healthcheck.api_host)
HOST_ENV = "OPENAI_HOST"
ENV = {"certfile": "OPENAI_SSL_CERTFILE", "keyfile": "OPENAI_SSL_KEYFILE", "ca_certs": "OPENAI_SSL_CA_CERTS",
       "cert_reqs": "OPENAI_SSL_CERT_REQS"}
CERT_REQS = (ssl.CERT_NONE, ssl.CERT_OPTIONAL, ssl.CERT_REQUIRED)  # 0, 1, 2


@dataclass(frozen=True)
class TlsFiles:
    certfile: str = ""  # the server's certificate chain (PEM), its key too unless keyfile is given
    keyfile: str = ""
    ca_certs: str = ""  # the CAs a client certificate is verified against
    cert_reqs: int = ssl.CERT_NONE

    @property
    def enabled(self) -> bool:
        return bool(self.certfile)

    @property
    def scheme(self) -> str:
        return "https" if self.enabled else "http"


def from_env(environ: Mapping[str, str] = os.environ) -> TlsFiles:
    """The OPENAI_SSL_* variables (a cert_reqs that is not a number is kept as -1: refused by `check`)."""
    reqs = environ.get(ENV["cert_reqs"], "").strip() or "0"
    return TlsFiles(environ.get(ENV["certfile"], ""), environ.get(ENV["keyfile"], ""),
                    environ.get(ENV["ca_certs"], ""), int(reqs) if reqs.lstrip("-").isdigit() else -1)


def add_flags(parser) -> None:
    default = from_env()
    parser.add_argument("--ssl-certfile", default=default.certfile, metavar="PEM",
                        help=f"serve over TLS with this certificate chain (vLLM's flag; default ${ENV['certfile']})")
    parser.add_argument("--ssl-keyfile", default=default.keyfile, metavar="PEM",
                        help=f"its private key, unless the certificate file holds it (default ${ENV['keyfile']})")
    parser.add_argument("--ssl-ca-certs", default=default.ca_certs, metavar="PEM",
                        help=f"the CAs client certificates are verified against (default ${ENV['ca_certs']})")
    parser.add_argument("--ssl-cert-reqs", type=int, default=default.cert_reqs, metavar="0|1|2",
                        help="client certificates: 0 not asked for, 1 verified if given, 2 required (default "
                             f"${ENV['cert_reqs']}, else 0)")


def from_args(args) -> TlsFiles:
    return TlsFiles(args.ssl_certfile, args.ssl_keyfile, args.ssl_ca_certs, args.ssl_cert_reqs)


def server_context(files: TlsFiles) -> ssl.SSLContext | None:
    """The API's TLS context (None: plain HTTP); ValueError naming the flag (and its variable) that is wrong."""
    if not files.enabled:
        for name in ("keyfile", "ca_certs"):
            if getattr(files, name):
                raise ValueError(f"{_flag(name)} needs --ssl-certfile ({ENV['certfile']})")
        if files.cert_reqs != ssl.CERT_NONE:
            raise ValueError(f"{_flag('cert_reqs')} needs --ssl-certfile ({ENV['certfile']})")
        return None
    if files.cert_reqs not in CERT_REQS:
        raise ValueError(f"{_flag('cert_reqs')} must be 0, 1 or 2, not {files.cert_reqs}")
    if files.cert_reqs != ssl.CERT_NONE and not files.ca_certs:
        raise ValueError(f"{_flag('cert_reqs')} {files.cert_reqs} verifies client certificates: it needs "
                         f"{_flag('ca_certs')}")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(files.certfile, files.keyfile or None)
    except (OSError, ssl.SSLError) as exc:
        names = f"{_flag('certfile')}" + (f" and {_flag('keyfile')}" if files.keyfile else "")
        raise ValueError(f"{names}: cannot load the certificate and its key ({_reason(exc)})") from None
    if files.ca_certs:
        try:
            context.load_verify_locations(files.ca_certs)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"{_flag('ca_certs')}: cannot load the CA certificates ({_reason(exc)})") from None
    context.verify_mode = ssl.VerifyMode(files.cert_reqs)
    return context


def probe_context(files: TlsFiles) -> ssl.SSLContext:
    """The context of the launcher's own checks of the API over the loopback (see the module's docstring)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    if files.cert_reqs == ssl.CERT_REQUIRED:
        context.load_cert_chain(files.certfile, files.keyfile or None)
    return context


def check_probe(files: TlsFiles) -> None:
    """Where client certificates are required, that the server accepts the launcher's own checks (which present
    its certificate): a handshake in memory between the two contexts; ValueError saying why not."""
    if files.cert_reqs != ssl.CERT_REQUIRED:
        return
    server_in, server_out, client_in, client_out = (ssl.MemoryBIO() for _ in range(4))
    server = server_context(files).wrap_bio(server_in, server_out, server_side=True)
    client = probe_context(files).wrap_bio(client_in, client_out, server_hostname="localhost")
    done = {server: False, client: False}
    try:
        for _ in range(20):  # a TLS 1.3 handshake takes a few turns
            for end, out, peer_in in ((client, client_out, server_in), (server, server_out, client_in)):
                if not done[end]:
                    try:
                        end.do_handshake()
                        done[end] = True
                    except ssl.SSLWantReadError:
                        pass
                peer_in.write(out.read())
            if all(done.values()):
                client.write(b"\0")  # TLS 1.3 checks the client's certificate after the client's handshake ends
                client_in.write(server_out.read())
                server_in.write(client_out.read())
                server.read(1)
                return
    except ssl.SSLError as exc:
        raise ValueError(f"{_flag('cert_reqs')} 2: the launcher's own checks of the API present its certificate "
                         f"({_flag('certfile')}), which {_flag('ca_certs')} does not accept ({_reason(exc)})") from None
    raise ValueError(f"{_flag('cert_reqs')} 2: the TLS handshake of the launcher's own checks did not finish")


def _flag(name: str) -> str:
    return f"--ssl-{name.replace('_', '-')} ({ENV[name]})"


def _reason(exc: Exception) -> str:
    return getattr(exc, "strerror", None) or getattr(exc, "reason", None) or str(exc)
