#!/bin/sh
# TrainMover node health check, for slurm.conf's HealthCheckProgram or for LBNL NHC.
#
#   HealthCheckProgram=/opt/trainmover/slurm_plugin/healthcheck.sh
#   HealthCheckInterval=60
#   HealthCheckNodeState=ANY,CYCLE
#
# slurmd runs it as root with SLURMD_NODENAME and nothing else: no PATH, no SLURM_CONF.
# Site settings come from /etc/trainmover/healthcheck.env, then healthcheck.env next to
# this script (both optional). They are *read*, never sourced: KEY=VALUE lines, the value
# taken literally (one pair of surrounding quotes removed), for these keys only:
#   SLURM_CONF=/etc/slurm/slurm.conf            the cluster to drain the node in
#   TRAINMOVER_PYTHON=/opt/trainmover/.venv/bin/python   (trainmover installed in it)
#   TRAINMOVER_HEALTHCHECK_ARGS="--state-dir /var/lib/trainmover/healthcheck --disk /var/spool/slurmd --min-free-gb 5"
# Arguments given to the script are passed on (NHC: add --no-drain, NHC drains itself).
# As the Epilog, add --fence-record (a wrapper: Epilog takes no arguments; docs/admin.md): a
# node the ending job held after fencing it is drained (trainmover/healthcheck/fence_record.py).
#
# Because it runs as root:
#   * it works from / and reads nothing relative to the directory it was started in;
#   * a healthcheck.env is used only when root owns it and its directory and neither is
#     writable by group or others (else it is ignored, with a message on stderr); the same
#     holds for the Python interpreter, which must be root's and not writable by others, and
#     for what it imports: its site-packages (where .pth files and an editable install's
#     finder live) and the trainmover package tree it finds (an editable install imports the
#     checkout), every file in them and every directory up to /;
#   * Python runs isolated (-I: no PYTHON* variables, no user site, neither the script's
#     directory nor the working directory on sys.path) in a clean environment holding only
#     PATH, SLURM_CONF and SLURMD_NODENAME;
#   * the run never takes longer than 10 s (timeout 9 s in all, then SIGKILL 1 s later).
# Exit 0: healthy; 1: fault (node drained with a reason starting "trainmover:" unless
# --no-drain); 2: not run (no trusted interpreter); 124/137: killed at the time limit.
PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export PATH
started_ms=$(date +%s%3N)
umask 077
set -f  # no globbing when TRAINMOVER_HEALTHCHECK_ARGS is split into words
here=$(CDPATH='' cd -- "$(dirname -- "$0")" && pwd -P) || exit 2
cd / || exit 2

say() { echo "trainmover healthcheck.sh: $*" >&2; }

# trusted PATH: PATH (followed if a link) and the directory holding it belong to root and
# are not writable by group or others.
trusted() {
    for p in "$1" "$(dirname -- "$1")"; do
        info=$(stat -L -c '%u %a' -- "$p" 2>/dev/null) || return 1
        case $info in
            "0 "*[2367]? | "0 "*[2367]) return 1 ;;  # group- or other-writable
            "0 "*) ;;
            *) return 1 ;;
        esac
    done
}

# read_env FILE: the three keys above from FILE's KEY=VALUE lines; nothing is executed.
read_env() {
    n=0
    while IFS= read -r line || [ -n "$line" ]; do
        n=$((n + 1))
        case $line in
            '' | '#'*) continue ;;
            SLURM_CONF=* | TRAINMOVER_PYTHON=* | TRAINMOVER_HEALTHCHECK_ARGS=*) ;;
            *) say "$1:$n ignored (only SLURM_CONF, TRAINMOVER_PYTHON, TRAINMOVER_HEALTHCHECK_ARGS are read)"; continue ;;
        esac
        key=${line%%=*}
        val=${line#*=}
        case $val in
            \"*\") val=${val#\"}; val=${val%\"} ;;
            \'*\') val=${val#\'}; val=${val%\'} ;;
        esac
        case $key in
            SLURM_CONF) SLURM_CONF=$val ;;
            TRAINMOVER_PYTHON) TRAINMOVER_PYTHON=$val ;;
            TRAINMOVER_HEALTHCHECK_ARGS) TRAINMOVER_HEALTHCHECK_ARGS=$val ;;
        esac
    done < "$1"
}

SLURM_CONF=/etc/slurm/slurm.conf
TRAINMOVER_PYTHON=$here/../.venv/bin/python
TRAINMOVER_HEALTHCHECK_ARGS=
for f in /etc/trainmover/healthcheck.env "$here/healthcheck.env"; do
    [ -e "$f" ] || continue
    if trusted "$f"; then
        read_env "$f"
    else
        say "$f ignored: it or its directory is not root's, or is writable by group or others"
    fi
done
python=$TRAINMOVER_PYTHON
if [ ! -x "$python" ]; then
    say "no Python interpreter at $python (set TRAINMOVER_PYTHON in healthcheck.env)"; exit 2
fi
if ! trusted "$python" || ! trusted "$(readlink -f -- "$python")"; then
    say "$python not used: it, its target or their directories are not root's, or are writable by group or others"
    exit 2
fi
# trusted_tree DIR: DIR and everything under it root's and not writable by group or others
# (what Python would import from there runs as root), and every directory above it root's and
# not writable by others unless sticky (/tmp: others cannot rename or replace what is root's).
trusted_tree() {
    trusted_one "$1" || return 1
    d=$(dirname -- "$1")
    while :; do
        trusted_one "$d" || trusted_sticky "$d" || return 1
        [ "$d" = / ] && break
        d=$(dirname -- "$d")
    done
    [ -z "$(find "$1" \( ! -user 0 -o -perm /022 \) -print -quit 2>/dev/null)" ]
}
trusted_one() {
    info=$(stat -L -c '%u %a' -- "$1" 2>/dev/null) || return 1
    case $info in
        "0 "*[2367]? | "0 "*[2367]) return 1 ;;
        "0 "*) return 0 ;;
        *) return 1 ;;
    esac
}
trusted_sticky() {
    info=$(stat -L -c '%u %a' -- "$1" 2>/dev/null) || return 1
    case $info in
        "0 "[1357]???) return 0 ;;  # root's, sticky
        *) return 1 ;;
    esac
}
# -S: the site directories' names (a virtual environment's too) without running their .pth
# files, which are checked before anything there runs
sites=$(timeout -k 1 3 "$python" -I -S -c 'import site; site.venv(None); print("\n".join(site.getsitepackages()))')
rc=$?
case $rc in 0) ;; 124 | 137) exit 124 ;; *) say "$python cannot name its site-packages"; exit 2 ;; esac
for site in $sites; do
    [ -d "$site" ] || continue
    if ! trusted_tree "$site"; then
        say "$site not used: it, a file in it or a directory above it is not root's, or is writable by group or others"
        exit 2
    fi
done
pkg=$(timeout -k 1 3 "$python" -I -c 'import importlib.util as u; s = u.find_spec("trainmover"); print(s.submodule_search_locations[0] if s and s.submodule_search_locations else "")')
case $? in 124 | 137) exit 124 ;; esac
if [ -z "$pkg" ] || ! trusted_tree "$pkg"; then
    say "trainmover package ${pkg:-(not found)} not used: it, a file in it or a directory above it is not root's, or is writable by group or others"
    exit 2
fi
node=${SLURMD_NODENAME:-$(hostname -s)}
# what is left of the 9 s (the checks above took some of it)
left_ms=$((9000 - ($(date +%s%3N) - started_ms)))
[ "$left_ms" -gt 0 ] || exit 124
left=$((left_ms / 1000)).$(printf %03d $((left_ms % 1000)))
# shellcheck disable=SC2086
# As the Epilog (--fence-record), the ending job as slurmd names it; nothing else of its environment
exec env -i PATH="$PATH" SLURM_CONF="$SLURM_CONF" SLURMD_NODENAME="$node" \
    SLURM_JOB_ID="${SLURM_JOB_ID:-}" SLURM_JOB_UID="${SLURM_JOB_UID:-}" SLURM_JOB_WORK_DIR="${SLURM_JOB_WORK_DIR:-}" \
    timeout -k 1 "$left" "$python" -I -m trainmover.cli healthcheck --node "$node" $TRAINMOVER_HEALTHCHECK_ARGS "$@"
