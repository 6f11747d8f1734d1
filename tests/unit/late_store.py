"""A rendezvous store for tests that fork their ranks: its server thread starts after the fork.

Why: a child forked while a thread of the parent holds a lock inherits it held. The store's
server thread resolves its peers' addresses (glibc's resolver lock): a rank forked while it
did hung in its own first lookup. The socket listens from the start, so ranks that connect
before the server runs wait in its backlog, not refused."""
import datetime
import socket

import torch.distributed as dist


class LateStore:
    def __init__(self, timeout: datetime.timedelta):
        self.server = socket.create_server(("127.0.0.1", 0), backlog=64)
        self.port = self.server.getsockname()[1]
        self.timeout, self.master = timeout, None

    def serve(self) -> None:
        """Call once every rank is forked."""
        self.master = dist.TCPStore("127.0.0.1", self.port, is_master=True, wait_for_workers=False,
                                    master_listen_fd=self.server.detach(), use_libuv=False,
                                    timeout=self.timeout)

    def close(self) -> None:
        self.master = None
