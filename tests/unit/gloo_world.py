"""Real gloo groups on threads of the test process: a TCPStore served on a free port and one
group a member, each built from its own store client, as on separate nodes."""
import datetime
import socket
import threading

import torch.distributed as dist

from trainmover.groups.swappable import gloo_group


def serve_store(timeout: datetime.timedelta) -> tuple[dist.TCPStore, int]:
    """(the master store, its port); the store serves as long as the master is referenced."""
    s = socket.create_server(("127.0.0.1", 0))
    port = s.getsockname()[1]
    master = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, master_listen_fd=s.detach(),
                           use_libuv=False, timeout=timeout)
    return master, port


def gloo_groups(port: int, prefix: str, world: int, timeout: datetime.timedelta) -> list:
    """`world` gloo groups under `prefix`, built on threads at once (each waits for the others);
    a member not built within 30 s is None."""
    out = [None] * world

    def build(r):
        client = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=timeout)
        out[r] = gloo_group(client, prefix, r, world, host="127.0.0.1", timeout=timeout)
    threads = [threading.Thread(target=build, args=(r,)) for r in range(world)]
    [t.start() for t in threads]
    [t.join(30) for t in threads]
    return out
