"""Run a command as one embedded node, or inside a Slurm root filesystem.

Started as `unshare [--uts] --mount --propagation private python -I -S nodeexec.py
[--root R --bind P ...] [--hostname NODE --hosts FILE] [--chdir D] -- argv`: inside the
fresh mount (and UTS) namespace it

* with --root: bind-mounts every --bind path (recursively) at the same path under R,
  so that /proc, /dev, the state directory, the checkout and the interpreter look the
  same inside as outside; these mounts live only in this namespace and vanish with its
  last process (the cached root filesystem never holds a mount that a later `rm -r`
  could descend into);
* with --hosts: bind-mounts FILE over /etc/hosts (R/etc/hosts with --root);
* with --hostname: sets the hostname, so that `hostname` in a job step prints the node;
* chroots into R, changes to --chdir (default: the directory it was started in) when
  that exists there (else /), and execs argv; a bare program name is looked for in R's
  /usr/sbin, /usr/bin, /sbin and /bin before PATH (whose first entries may be another
  cluster's wrapper scripts).

Standard library only: it runs by path (`python -I -S`), without importing trainmover.
"""

import argparse
import ctypes
import os
import socket
import sys

MS_BIND = 4096
MS_REC = 16384


def _bind(source: str, target: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)  # the C library this interpreter already loaded
    if libc.mount(source.encode(), target.encode(), None, MS_BIND | MS_REC, None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"nodeexec: cannot bind-mount {source} on {target}: {os.strerror(err)}")


def _inside(root: str, path: str) -> str:
    return os.path.join(root, path.lstrip("/"))


def _searchable_as_outside(root: str, path: str) -> None:
    """Each directory on the way to a bound `path` inside `root` lets others pass (o+x) where
    the host's does: a job's user reaches the bound interpreter inside as outside (the root's
    own /root is 0700, where pyenv's interpreter lives on the host, made o+x by setup.sh)."""
    parts = os.path.normpath(path).strip("/").split("/")
    for i in range(1, len(parts)):
        outside = "/" + "/".join(parts[:i])
        inside = _inside(root, outside)
        try:
            if os.stat(outside).st_mode & 0o001 and not os.lstat(inside).st_mode & 0o001:
                os.chmod(inside, os.lstat(inside).st_mode & 0o7777 | 0o001)
        except OSError:
            return


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="nodeexec")
    p.add_argument("--root", help="root filesystem to chroot into")
    p.add_argument("--bind", action="append", default=[], help="host path to show at the same path under --root")
    p.add_argument("--hostname")
    p.add_argument("--hosts", help="file to bind-mount over /etc/hosts")
    p.add_argument("--chdir", help="working directory inside (when it exists there; default: the current one)")
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        p.error("no command given")
    root = args.root or "/"
    cwd = args.chdir or os.getcwd()
    mounts = [(path, _inside(root, path)) for path in args.bind]
    if args.hosts:
        mounts.append((args.hosts, _inside(root, "/etc/hosts")))
    for source, target in mounts:
        if os.path.isdir(source):
            os.makedirs(target, exist_ok=True)
            if args.root:
                _searchable_as_outside(root, source)
        elif not os.path.exists(target):
            open(target, "a").close()
        _bind(source, target)
    if args.hostname:
        socket.sethostname(args.hostname)
    if args.root:
        os.chroot(root)
        os.chdir(cwd if os.path.isdir(cwd) else "/")
        if "/" not in cmd[0]:
            found = [f"{d}/{cmd[0]}" for d in ("/usr/sbin", "/usr/bin", "/sbin", "/bin") if os.path.isfile(f"{d}/{cmd[0]}")]
            cmd = [found[0], *cmd[1:]] if found else cmd
    os.execvp(cmd[0], cmd)
    return 127  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
