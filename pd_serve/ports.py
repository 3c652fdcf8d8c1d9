"""TCP ports: a free one, for the servers and process groups pd-serve starts on this host, and
binding a zmq socket to the one a flag gives."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def bind_zmq(sock, host: str, port: int, flags: tuple[str, str] = ("--host", "--port"),
             what: str = "") -> int:
    """Bind sock to tcp://host:port (port 0: any free one) and return the port. A bind that
    fails (the port in use, a host not this machine's) closes sock and is a ValueError naming
    the host and port flags that gave the address (cli.main prints it as one line). zmq is
    imported here: the in-process Engine uses free_port and must not need it."""
    import zmq

    try:
        if port:
            sock.bind(f"tcp://{host}:{port}")
            return port
        return sock.bind_to_random_port(f"tcp://{host}")
    except zmq.ZMQError as e:
        sock.close()
        raise ValueError(f"{flags[0]} {host} {flags[1]} {port}: {what}cannot bind "
                         f"({e.strerror})") from None
