"""Why a port could not be bound, in words that point the operator the right way.

"Is another agent running on it?" is the answer to one failure only (the
address in use); for a host name that does not resolve, or an address this
box does not have, it sends the operator looking for a process that is not
there.
"""
from __future__ import annotations

import errno
import socket


def why_bind_failed(exc: BaseException) -> str:
    """A short reason for a failed bind (an OSError, a socket.gaierror or a zmq.ZMQError)."""
    code = getattr(exc, "errno", None)
    text = getattr(exc, "strerror", None) or str(exc)
    if isinstance(exc, socket.gaierror):
        return f"{text} (is the host name or address right?)"
    if code == errno.EADDRINUSE:
        return f"{text} (is another agent running on it?)"
    if code in (errno.EADDRNOTAVAIL, errno.ENODEV):
        return f"{text} (this box has no such address; is the host right?)"
    if code == errno.EACCES:
        return f"{text} (ports below 1024 need privileges)"
    return text
