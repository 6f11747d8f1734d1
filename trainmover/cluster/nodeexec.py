"""Run a command as one embedded node: own hostname, own /etc/hosts.

Started as `unshare --uts --mount --propagation private python nodeexec.py
--hostname NODE --hosts FILE -- slurmd ...`: inside the fresh UTS and mount
namespaces it sets the hostname, bind-mounts FILE over /etc/hosts and execs the
command, so that `hostname` in a job step prints the node's name. Standard
library only: it runs by path, without importing trainmover.
"""

import argparse
import os
import socket
import subprocess
import sys


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="nodeexec")
    p.add_argument("--hostname", required=True)
    p.add_argument("--hosts", required=True)
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        p.error("no command given")
    socket.sethostname(args.hostname)
    subprocess.run(["mount", "--bind", args.hosts, "/etc/hosts"], check=True, timeout=30)
    os.execvp(cmd[0], cmd)
    return 127  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
