#!/usr/bin/env bash
# The system packages the real KV path's transports need, on Debian or Ubuntu: libibverbs
# (Mooncake's engine loads it even for TCP) and pyverbs, made visible to the interpreter that
# runs this script (Debian installs pyverbs for the system Python only, so a .pth file in this
# interpreter's site-packages points at it). Without them the transport tests skip, naming
# the package. Run once per environment: bash scripts/install-rdma-packages.sh
set -euo pipefail
PYTHON=${PYTHON:-python}
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install-rdma-packages: no apt-get here; install libibverbs1 and python3-pyverbs" \
         "(rdma-core) with this system's package manager" >&2
    exit 0
fi
SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq libibverbs1 ibverbs-providers python3-pyverbs
if [ -d /usr/lib/python3/dist-packages/pyverbs ]; then
    site=$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    echo /usr/lib/python3/dist-packages > "$site/debian-pyverbs.pth"
    echo "install-rdma-packages: pyverbs visible to $("$PYTHON" -c 'import sys; print(sys.executable)')"
fi
