#!/bin/bash
# Installs Debian's bcc (python3-bpfcc, 0.26 on bookworm) so krex's eBPF probes can compile and load.
# Run as root on Debian bookworm; safe to run again (each step checks before it acts).
#   .ci/install-bcc.sh [VENV]
# - apt-get installs python3-bpfcc (pulls libbpfcc, LLVM/clang 14) when `import bcc` fails for python3.
# - When /lib/modules/$(uname -r)/build is missing (kernels not built by Debian, e.g. Firecracker VMs),
#   installs the linux-headers-*-amd64 package that linux-headers-amd64 depends on (and its -common)
#   and links /lib/modules/$(uname -r)/{build,source} to them. Only tracepoint arguments and uprobes
#   are safe with such headers: krex never reads kernel structs.
# - Mounts tracefs and debugfs where they are not mounted.
# - With VENV: writes VENV's site-packages/krex-bcc.pth naming bcc's directory, so that venv's python
#   can `from bcc import BPF` (bcc is pure Python over libbcc.so; the venv must be Python 3.x).
set -euo pipefail
[ "$(id -u)" = 0 ] || { echo "install-bcc: must run as root" >&2; exit 1; }
export DEBIAN_FRONTEND=noninteractive
K=$(uname -r)
updated=0
apt_update() { [ $updated = 1 ] || { apt-get update -qq; updated=1; }; }

if ! /usr/bin/python3 -c 'import bcc' 2>/dev/null; then
    apt_update
    apt-get install -y -qq --no-install-recommends python3-bpfcc libbpfcc >/dev/null
fi

if [ ! -e "/lib/modules/$K/build/include" ]; then
    hdr=""
    if dpkg -s "linux-headers-$K" >/dev/null 2>&1 || apt-cache show "linux-headers-$K" >/dev/null 2>&1; then
        hdr="linux-headers-$K"           # a Debian kernel: its own headers
    else
        apt_update
        hdr=$(apt-cache depends linux-headers-amd64 | awk '/Depends: linux-headers-/{print $2; exit}')
    fi
    [ -n "$hdr" ] || { echo "install-bcc: no linux-headers package found" >&2; exit 1; }
    dpkg -s "$hdr" >/dev/null 2>&1 || { apt_update; apt-get install -y -qq --no-install-recommends "$hdr" >/dev/null; }
    if [ ! -e "/lib/modules/$K/build/include" ]; then
        common=${hdr%-amd64}-common
        mkdir -p "/lib/modules/$K"
        ln -sfn "/usr/src/$hdr" "/lib/modules/$K/build"
        ln -sfn "/usr/src/$common" "/lib/modules/$K/source"
        echo "install-bcc: linked /lib/modules/$K/{build,source} to /usr/src/$hdr (+common)"
    fi
fi

mountpoint -q /sys/kernel/tracing || mount -t tracefs nodev /sys/kernel/tracing
mountpoint -q /sys/kernel/debug || mount -t debugfs none /sys/kernel/debug

if [ $# -ge 1 ]; then
    venv=$1
    py="$venv/bin/python"
    [ -x "$py" ] || { echo "install-bcc: $py not found" >&2; exit 1; }
    site=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    # Name a directory holding only bcc, not all of Debian's dist-packages (they would shadow the venv's).
    mkdir -p /usr/local/lib/krex-bcc
    ln -sfn /usr/lib/python3/dist-packages/bcc /usr/local/lib/krex-bcc/bcc
    echo /usr/local/lib/krex-bcc > "$site/krex-bcc.pth"
    "$py" -c 'from bcc import BPF' || { echo "install-bcc: $py cannot import bcc" >&2; exit 1; }
fi
py=${py:-/usr/bin/python3}
"$py" -c 'from bcc import BPF; BPF(text="int f(void *c) { return 0; }")' \
    && echo "install-bcc: bcc works on $K"
