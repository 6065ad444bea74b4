"""Why a port could not be bound, in words that point the operator the right way.

"Is another agent running on it?" is the answer to one failure only (the
address in use); for a host name that does not resolve, or an address this
box does not have, it sends the operator looking for a process that is not
there.
"""
from __future__ import annotations

import errno
import re
import socket


def why_bind_failed(exc: BaseException, endpoint: str | None = None) -> str:
    """A short reason for a failed bind (an OSError, a socket.gaierror or a zmq.ZMQError).

    `endpoint` (`tcp://host:port`, `ipc://path`, `host:port`) picks the hint for a refused bind; without it
    the address pyzmq puts in its error (`(addr='ipc://...')`) does.
    """
    code = getattr(exc, "errno", None)
    text = getattr(exc, "strerror", None) or str(exc)
    if isinstance(exc, socket.gaierror):
        return f"{text} (is the host name or address right?)"
    if code == errno.EADDRINUSE:
        return f"{text} (is another agent running on it?)"
    if code in (errno.EADDRNOTAVAIL, errno.ENODEV):
        return f"{text} (this box has no such address; is the host right?)"
    if code == errno.EACCES:
        hint = _denied_hint(endpoint or str(exc))
        return f"{text} ({hint})" if hint else text
    return text


def _denied_hint(where: str) -> str:
    """Why a bind to `where` may be refused: an ipc socket is a file, so its folder must be writable; only a
    TCP port below 1024 needs privileges (port 0 is any free port)."""
    if "ipc://" in where:
        return "the ipc socket's folder is not writable by this user"
    ports = re.findall(r":(\d+)\b", where)
    if not ports:
        return "ports below 1024 need privileges; an ipc:// socket needs a writable folder"
    return "ports below 1024 need privileges" if 0 < int(ports[-1]) < 1024 else ""
