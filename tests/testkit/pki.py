"""A throwaway PKI for the router security tests, made with the openssl command line."""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

GEN_TOKEN, ADMIN_TOKEN, DIGEST_TOKEN = "gen-token-0123", "admin-token-4567", "digest-token-89"


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _issue(d: Path, name: str, ca: str, san: str | None = None) -> None:
    """An EC key + certificate signed by CA ``ca`` (files <name>.key / <name>.pem in ``d``)."""
    _openssl("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
    ext = d / f"{name}.ext"
    ext.write_text(f"subjectAltName={san}\n" if san else "basicConstraints=CA:FALSE\n")
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
             "-out", f"{name}.pem", "-days", "2", "-extfile", ext.name, cwd=d)


def make_pki(d: Path) -> Path:
    """Two CAs (``ca``, ``other_ca``), a server certificate for localhost signed by ``ca``, a client
    certificate from ``ca`` and a stranger's from ``other_ca`` (``<name>.key`` / ``<name>.pem``), and a
    ``tokens`` file holding the three test tokens (one stored as a sha256 digest), all under ``d``."""
    for ca in ("ca", "other_ca"):
        _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                 "-keyout", f"{ca}.key", "-out", f"{ca}.pem", "-days", "2", "-subj", f"/CN={ca}", cwd=d)
    _issue(d, "server", "ca", san="DNS:localhost,IP:127.0.0.1")
    _issue(d, "client", "ca")
    _issue(d, "stranger", "other_ca")
    (d / "tokens").write_text(f"# test tokens\n{GEN_TOKEN}\n{ADMIN_TOKEN}  generate,admin  # ops\n"
                              f"sha256:{hashlib.sha256(DIGEST_TOKEN.encode()).hexdigest()} generate\n")
    return d
