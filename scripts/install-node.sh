#!/usr/bin/env bash
#: Installs krex on a node for its systemd units (docs/install.md): the package with its extras in its
#: own virtual environment (a copy, not this checkout) built from an interpreter every user can run,
#: `krex` on PATH, the daemon's unit and config, and (unless --no-gateway) the gateway: its unit, its
#: token file and the unprivileged user its jobs run as, in the daemon's socket group. Checks the
#: units with `systemd-analyze verify` and, as root, that other users can run what it installed.
#: Idempotent; an existing config or token file is never overwritten.
#:
#:   sudo scripts/install-node.sh [--prefix /opt/krex] [--python PATH] [--extras nvidia,metrics,gateway]
#:        [--bin /usr/local/bin] [--unit-dir /etc/systemd/system] [--conf-dir /etc/krex]
#:        [--socket-group krex] [--job-user krexjob] [--listen 127.0.0.1:8000] [--no-gateway] [--no-bcc]
#:
#:   --python PATH  the interpreter to build the environment from (default: the first of python3 on
#:                  PATH, /usr/bin/python3, /usr/local/bin/python3 that every user can run; $PYTHON
#:                  is the same as --python). One under a private directory (~/.pyenv) is refused.
#:   --socket-group the group that may reach the daemon's socket (created if missing; written to a
#:                  new config as socket_group)
#:   --job-user     the unprivileged user the gateway's jobs run as (created if missing, a member of
#:                  the socket group; written to a new config as pool_user, to the gateway unit as
#:                  --run-as)
#:   --listen       the gateway's HOST:PORT (one that is not loopback is written with --allow-remote)
#:
#: Then: systemctl daemon-reload && systemctl enable --now krex krex-gateway   (printed at the end)
set -euo pipefail
umask 022 # the environment, links and units must be readable by every user, whatever root's umask
cd "$(dirname "$0")/.."
REPO=$PWD
PREFIX=/opt/krex EXTRAS=nvidia,metrics,gateway BIN=/usr/local/bin UNIT_DIR=/etc/systemd/system
CONF_DIR=/etc/krex BCC=1 PY=${PYTHON:-} GROUP=krex JOB_USER=krexjob LISTEN=127.0.0.1:8000 GATEWAY=1

usage() { sed -n 's/^#: \{0,1\}//p' "$0"; }
die() {
    echo "install-node: $*" >&2
    exit 1
}
need() { [ $# -ge 2 ] && [ -n "$2" ] || { echo "install-node: $1 needs a value (--help)" >&2; exit 2; }; }
while [ $# -gt 0 ]; do
    case "$1" in
        --prefix | --python | --extras | --bin | --unit-dir | --conf-dir | --socket-group | --job-user | --listen)
            need "$@"
            case "$1" in
                --prefix) PREFIX=$2 ;; --python) PY=$2 ;; --extras) EXTRAS=$2 ;; --bin) BIN=$2 ;;
                --unit-dir) UNIT_DIR=$2 ;; --conf-dir) CONF_DIR=$2 ;; --socket-group) GROUP=$2 ;;
                --job-user) JOB_USER=$2 ;; --listen) LISTEN=$2 ;;
            esac
            shift 2
            ;;
        --no-gateway) GATEWAY=0; shift ;;
        --no-bcc) BCC=0; shift ;;
        -h | --help) usage; exit 0 ;;
        *) echo "install-node: unknown argument $1 (--help)" >&2; exit 2 ;;
    esac
done
for p in PREFIX BIN UNIT_DIR CONF_DIR; do
    case "${!p}" in /*) ;; *) echo "install-node: --$(echo "$p" | tr 'A-Z_' 'a-z-') must be an absolute path" >&2; exit 2 ;; esac
done
for v in "$PREFIX" "$BIN" "$UNIT_DIR" "$CONF_DIR"; do # written into units and sed expressions
    [[ "$v" =~ ^[A-Za-z0-9_./+@:-]+$ ]] || { echo "install-node: unusual characters in path $v" >&2; exit 2; }
done
for v in "$GROUP" "$JOB_USER"; do
    [[ "$v" =~ ^[a-z_][a-z0-9_-]*$ ]] || { echo "install-node: $v is not a user or group name" >&2; exit 2; }
done
[[ "$LISTEN" =~ ^[][A-Za-z0-9.:-]+:[0-9]+$ ]] || { echo "install-node: --listen $LISTEN must be HOST:PORT" >&2; exit 2; }
REMOTE="" # an address other than loopback, chosen here, is the gateway's --allow-remote (tokens stay required)
case "${LISTEN%:*}" in 127.* | localhost | "[::1]") ;; *) REMOTE=" --allow-remote" ;; esac
ROOT=0
[ "$(id -u)" = 0 ] && ROOT=1

# What every user must be able to run: the interpreter (its real file, not a link or a pyenv shim)
# and its standard library, each with every directory above it searchable by others. Prints
# "ok REALPATH", or "no WHY". Run by the candidate itself, so it answers for what `-m venv` links to.
CHECK_PY='
import os, stat, sys, sysconfig
def blocked(path, end):
    parts = path.split("/")
    for i in range(1, len(parts) + 1):
        p = "/".join(parts[:i]) or "/"
        need = end if i == len(parts) else 0o001
        mode = stat.S_IMODE(os.stat(p).st_mode)
        if mode & need != need:
            what = "enter" if need == 0o001 else "read and run"
            return f"{p} has mode {mode:04o}: other users cannot {what} it"
    return ""
exe = os.path.realpath(sys.executable)
why = "" if sys.version_info < (3, 11) else (
    blocked(exe, 0o005) or blocked(os.path.realpath(sysconfig.get_path("stdlib")), 0o005))
if sys.version_info < (3, 11):
    print(f"no {exe} is Python {sys.version.split()[0]}; krex needs 3.11 or later")
elif why:
    print(f"no {exe}: {why}")
else:
    try:
        import ensurepip, venv  # noqa: F401
    except ImportError:
        print(f"no {exe} has no venv/ensurepip: apt-get install python3-venv")
    else:
        print(f"ok {exe}")
'
check_python() { "$1" -c "$CHECK_PY" 2>/dev/null || echo "no $1 does not run"; }

pick_python() {
    local c out first=""
    if [ -n "$PY" ]; then
        out=$(check_python "$PY")
        [ "${out%% *}" = ok ] || {
            echo "install-node: --python $PY cannot serve every user: ${out#no }" >&2
            echo "install-node: pass --python of an interpreter outside private directories, e.g. /usr/bin/python3" >&2
            exit 2
        }
        REAL_PY=${out#ok }
        return
    fi
    for c in "$(command -v python3 || true)" /usr/bin/python3 /usr/local/bin/python3; do
        [ -n "$c" ] && [ -x "$c" ] || continue
        out=$(check_python "$c")
        if [ "${out%% *}" = ok ]; then
            REAL_PY=${out#ok }
            [ -z "$first" ] || echo "install-node: not $first (${first_why}); using $REAL_PY" >&2
            return
        fi
        [ -n "$first" ] || { first=$c; first_why=${out#no }; }
    done
    echo "install-node: no python3 here that every user can run${first:+ ($first: $first_why)}" >&2
    echo "install-node: install one (apt-get install python3 python3-venv) or pass --python PATH" >&2
    exit 2
}

# The prefix's existing parents must be searchable by others too: the venv's bin/ is under it.
prefix_blocked() {
    local p=$PREFIX
    while [ ! -e "$p" ]; do p=$(dirname "$p"); done
    while :; do
        [ $(($(stat -L -c '0%a' "$p") & 1)) = 1 ] || { echo "$p has mode $(stat -L -c %a "$p")"; return; }
        [ "$p" = / ] && return
        p=$(dirname "$p")
    done
}

pick_python
[ -z "$(prefix_blocked)" ] || die "--prefix $PREFIX: other users cannot reach it ($(prefix_blocked))"
if [ "$GATEWAY" = 1 ]; then
    [[ ",$EXTRAS," == *,gateway,* ]] || EXTRAS=${EXTRAS:+$EXTRAS,}gateway # the gateway needs aiohttp
    if ! getent group "$GROUP" >/dev/null || ! id -u "$JOB_USER" >/dev/null 2>&1; then
        [ "$ROOT" = 1 ] || die "creating group $GROUP and user $JOB_USER needs root (or --no-gateway)"
    fi
    [ "$JOB_USER" != root ] && [ "$(id -u "$JOB_USER" 2>/dev/null || echo 1)" != 0 ] ||
        die "--job-user $JOB_USER: jobs never run as root"
fi

# An environment left by an older install from an interpreter others cannot run is rebuilt.
if [ -x "$PREFIX/bin/python" ]; then
    out=$(check_python "$PREFIX/bin/python")
    if [ "${out%% *}" != ok ]; then
        echo "install-node: rebuilding $PREFIX: ${out#no }" >&2
        "$REAL_PY" -m venv --clear "$PREFIX"
    fi
else
    "$REAL_PY" -m venv "$PREFIX"
fi
"$PREFIX/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
"$PREFIX/bin/python" -m pip install -q "$REPO${EXTRAS:+[$EXTRAS]}"
if [ "$BCC" = 1 ] && [ "$ROOT" = 1 ] && command -v apt-get >/dev/null; then
    "$REPO/.ci/install-bcc.sh" "$PREFIX" || echo "install-node: bcc not installed; probes off" >&2
fi
install -d "$BIN" "$UNIT_DIR" "$CONF_DIR"
ln -sfn "$PREFIX/bin/krex" "$BIN/krex"

# The socket group and the jobs' user, before a config that names them is checked.
if [ "$GATEWAY" = 1 ]; then
    getent group "$GROUP" >/dev/null || groupadd --system "$GROUP"
    if ! id -u "$JOB_USER" >/dev/null 2>&1; then
        useradd --system --user-group --groups "$GROUP" --home-dir /nonexistent --no-create-home \
            --shell /usr/sbin/nologin --comment "krex gateway jobs" "$JOB_USER"
    elif ! id -nG "$JOB_USER" | tr ' ' '\n' | grep -qx "$GROUP"; then
        [ "$ROOT" = 1 ] || die "user $JOB_USER is not in group $GROUP: usermod -aG $GROUP $JOB_USER"
        usermod -aG "$GROUP" "$JOB_USER"
    fi
fi

# Units and files name the default paths: written with the ones chosen here.
subst() {
    sed -e "s#/usr/local/bin/krex#$BIN/krex#g" -e "s#/etc/krex/#$CONF_DIR/#g" \
        -e "s#/opt/krex/#$PREFIX/#g" -e "s#--run-as krexjob#--run-as $JOB_USER#" \
        -e "s#--listen 127.0.0.1:8000#--listen $LISTEN$REMOTE#" -e "s#--socket /run/krex/krex.sock#--socket $SOCK#" "$1"
}
put() { # stdin to DEST with MODE: atomically, through a temporary file beside DEST
    cat >"$1.tmp"
    chmod "$2" "$1.tmp"
    mv "$1.tmp" "$1"
}
if [ ! -e "$CONF_DIR/krex.toml" ]; then
    if [ "$GATEWAY" = 1 ]; then
        sed -e "s/^socket_group = \"\"/socket_group = \"$GROUP\"/" \
            -e "s/^pool_user = \"\"/pool_user = \"$JOB_USER\"/" packaging/krex.toml.example |
            put "$CONF_DIR/krex.toml" 0644
    else
        put "$CONF_DIR/krex.toml" 0644 <packaging/krex.toml.example
    fi
fi
CONF=$("$BIN/krex" serve --config "$CONF_DIR/krex.toml" --print-config)
conf() { sed -n "s/^$1 *= *\"\\([^\"]*\\)\".*/\\1/p" <<<"$CONF" | head -1; }
SOCK=$(conf socket)
SOCK=${SOCK:-/run/krex/krex.sock} # the gateway's --socket: the daemon's, as the config says
subst packaging/krex.service | put "$UNIT_DIR/krex.service" 0644
UNITS=("$UNIT_DIR/krex.service")
case "$(conf state_dir)" in /run/krex | /run/krex/*)
    echo "install-node: WARNING: $CONF_DIR/krex.toml sets state_dir = \"$(conf state_dir)\", which the unit" \
        "removes at every stop: set it to \"\" (/var/lib/krex) to keep records across restarts" >&2 ;;
esac
if [ "$GATEWAY" = 1 ]; then
    # A kept config must agree with the gateway: its jobs reach the socket through the group, and
    # the warm pool serves only its --pool-user's commands.
    sg=$(conf socket_group)
    [ "$sg" = "$GROUP" ] || die "$CONF_DIR/krex.toml has socket_group = \"$sg\", but the gateway's jobs" \
        "run as $JOB_USER in group $GROUP: set socket_group = \"$GROUP\" there (or pass --socket-group \"$sg\")"
    pu=$(conf pool_user)
    [ "$pu" = "$JOB_USER" ] || echo "install-node: WARNING: $CONF_DIR/krex.toml has pool_user = \"$pu\":" \
        "the warm pool will not serve the gateway's jobs (run as $JOB_USER); set pool_user = \"$JOB_USER\"" >&2
    TOKEN=$CONF_DIR/gateway.token
    if [ ! -e "$TOKEN" ]; then # 0600, root's: the gateway (root) refuses a token file others can read
        (umask 077 && "$PREFIX/bin/python" -c 'import secrets; print(secrets.token_urlsafe(32))' >"$TOKEN.tmp")
        mv "$TOKEN.tmp" "$TOKEN"
    fi
    subst packaging/krex-gateway.service | put "$UNIT_DIR/krex-gateway.service" 0644
    UNITS+=("$UNIT_DIR/krex-gateway.service")
fi
if command -v systemd-analyze >/dev/null; then
    (cd / && systemd-analyze verify "${UNITS[@]}")
fi

# What the users will run, run as them: any user runs `krex`; the jobs' user runs the jobs'
# interpreter, imports krex's region client with it, and is in the socket group.
as_user() { runuser -u "$1" -- "${@:2}"; }
if [ "$ROOT" = 1 ] && command -v runuser >/dev/null; then
    out=$(as_user nobody "$BIN/krex" --version 2>&1) ||
        die "FAILED: user nobody cannot run $BIN/krex: $out (files an older install left unreadable" \
            "by others? rm -r $PREFIX and run this again)"
    if [ "$GATEWAY" = 1 ]; then
        out=$(as_user "$JOB_USER" "$PREFIX/bin/python" -c 'import krex_async.client.region' 2>&1) ||
            die "FAILED: user $JOB_USER cannot import krex's region client with $PREFIX/bin/python: $out"
    fi
else
    echo "install-node: not root: did not check that other users can run $BIN/krex" >&2
fi

echo "install-node: krex $("$BIN/krex" --version | cut -d' ' -f2) in $PREFIX (from $REAL_PY), $BIN/krex," \
    "${UNITS[*]}, $CONF_DIR/krex.toml"
if [ "$GATEWAY" = 1 ]; then
    echo "install-node: gateway jobs run as $JOB_USER (group $GROUP); token in $TOKEN; add the users" \
        "who may use the daemon to $GROUP (usermod -aG $GROUP NAME)"
    echo "install-node: next: systemctl daemon-reload && systemctl enable --now krex krex-gateway && krex doctor"
else
    echo "install-node: next: systemctl daemon-reload && systemctl enable --now krex && krex doctor"
fi
