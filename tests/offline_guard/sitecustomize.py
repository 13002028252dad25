"""Loaded at start-up by a Python whose PYTHONPATH names this folder (tests/offline.py):
with HF_PAGED_NETWORK_LOG set, every name lookup and connection beyond loopback is written to that file
and fails as an unreachable network would, so a test sees each attempt instead of a timeout."""

import errno
import ipaddress
import os
import socket

_LOG = os.environ.get("HF_PAGED_NETWORK_LOG")


def _is_local(host) -> bool:
    if host in (None, "", "localhost"):
        return True
    try:
        return ipaddress.ip_address(str(host).split("%")[0]).is_loopback or str(host) in ("0.0.0.0", "::")
    except ValueError:
        return False


def _refuse(what: str):
    with open(_LOG, "a") as log:
        log.write(what + "\n")
    raise OSError(errno.ENETUNREACH, f"network unreachable (offline test): {what}")


if _LOG:
    _getaddrinfo, _connect, _connect_ex = socket.getaddrinfo, socket.socket.connect, socket.socket.connect_ex

    def getaddrinfo(host, *args, **kwargs):
        if not _is_local(host):
            _refuse(f"getaddrinfo {host}")
        return _getaddrinfo(host, *args, **kwargs)

    def connect(self, address):
        if self.family in (socket.AF_INET, socket.AF_INET6) and not _is_local(address[0]):
            _refuse(f"connect {address}")
        return _connect(self, address)

    def connect_ex(self, address):
        if self.family in (socket.AF_INET, socket.AF_INET6) and not _is_local(address[0]):
            _refuse(f"connect_ex {address}")
        return _connect_ex(self, address)

    socket.getaddrinfo, socket.socket.connect, socket.socket.connect_ex = getaddrinfo, connect, connect_ex
