#!/usr/bin/env bash
# Installs krex on a node for the systemd unit: the package with its extras in its own virtual
# environment (a copy, not this checkout), `krex` on PATH, the unit and the config, then checks the
# unit with `systemd-analyze verify`. Idempotent; an existing config is never overwritten.
#
#   sudo scripts/install-node.sh [--prefix /opt/krex] [--extras nvidia,metrics] [--bin /usr/local/bin]
#                                [--unit-dir /etc/systemd/system] [--conf-dir /etc/krex] [--no-bcc]
#
# Then: systemctl daemon-reload && systemctl enable --now krex   (the script prints this line)
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
PREFIX=/opt/krex EXTRAS=nvidia,metrics BIN=/usr/local/bin UNIT_DIR=/etc/systemd/system
CONF_DIR=/etc/krex BCC=1 PY=${PYTHON:-python3}
while [ $# -gt 0 ]; do
    case "$1" in
        --prefix) PREFIX=$2; shift 2 ;;
        --extras) EXTRAS=$2; shift 2 ;;
        --bin) BIN=$2; shift 2 ;;
        --unit-dir) UNIT_DIR=$2; shift 2 ;;
        --conf-dir) CONF_DIR=$2; shift 2 ;;
        --no-bcc) BCC=0; shift ;;
        -h|--help) sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "install-node: unknown argument $1 (--help)" >&2; exit 2 ;;
    esac
done

[ -x "$PREFIX/bin/python" ] || "$PY" -m venv "$PREFIX"
"$PREFIX/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
"$PREFIX/bin/python" -m pip install -q "$REPO${EXTRAS:+[$EXTRAS]}"
if [ "$BCC" = 1 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    "$REPO/.ci/install-bcc.sh" "$PREFIX" || echo "install-node: bcc not installed; probes off" >&2
fi
install -d "$BIN" "$UNIT_DIR" "$CONF_DIR"
ln -sfn "$PREFIX/bin/krex" "$BIN/krex"
# The unit names /usr/local/bin/krex and /etc/krex/krex.toml: written with the paths chosen here.
sed -e "s#/usr/local/bin/krex#$BIN/krex#g" -e "s#/etc/krex/krex.toml#$CONF_DIR/krex.toml#g" \
    packaging/krex.service > "$UNIT_DIR/krex.service.tmp"
chmod 0644 "$UNIT_DIR/krex.service.tmp"
mv "$UNIT_DIR/krex.service.tmp" "$UNIT_DIR/krex.service"
[ -e "$CONF_DIR/krex.toml" ] || install -m 0644 packaging/krex.toml.example "$CONF_DIR/krex.toml"
"$BIN/krex" serve --config "$CONF_DIR/krex.toml" --print-config >/dev/null
if command -v systemd-analyze >/dev/null; then
    (cd / && systemd-analyze verify "$UNIT_DIR/krex.service")
fi
echo "install-node: krex $("$BIN/krex" --version | cut -d' ' -f2) in $PREFIX, $BIN/krex," \
     "$UNIT_DIR/krex.service, $CONF_DIR/krex.toml"
echo "install-node: next: systemctl daemon-reload && systemctl enable --now krex && krex doctor"
