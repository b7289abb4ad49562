#!/usr/bin/env bash
# A second environment for the compat tier: another megatron-core in front of the locked set.
#
#   bash tools/compat/install.sh            # the newest release, pinned in requirements/compat-newest.txt
#   bash tools/compat/install.sh 0.18.2     # any other release (triton as pinned there)
#
# Makes .cache/compat/megatron-core-<version>/: a venv (same Python as .venv) whose own site-packages
# hold megatron-core <version> and triton, and which sees .venv's packages behind them (a .pth file
# adds .venv's site-packages with site.addsitedir, so its editable megatron_flash and the rest of
# the lock are found, and megatron-core is taken from the front). Its bin/python is the
# interpreter `make test-compat` runs the tier with; tests start subprocesses with sys.executable,
# so every torchrun rank and engine server runs on the same megatron-core. Idempotent: a stamp
# holds what was installed; a different version or pin builds it again.
#
# --ignore-requires-python: megatron-core 0.17+ declares Requires-Python >= 3.12, but its wheels are
# tagged per CPython and 0.19.2 still ships a cp311 wheel, which installs and runs on 3.11 (CI's
# Python). The flag is passed only when this Python is older than 3.12; once no cp311 wheel is
# published, pip finds none and this script fails — the tier then needs a Python 3.12 .venv.
set -euo pipefail
cd "$(dirname "$0")/../.."
PINS=requirements/compat-newest.txt
VERSION=${1:-$(sed -n 's/^megatron-core==//p' "$PINS")}
TRITON=$(sed -n 's/^triton==//p' "$PINS")
BASE=${BASE_VENV:-.venv}
DIR=.cache/compat/megatron-core-$VERSION
WANT="megatron-core==$VERSION triton==$TRITON base=$(readlink -f "$BASE")"

[ -x "$BASE/bin/python" ] || { echo "compat: $BASE/bin/python missing: build the locked venv first (make .venv/.installed)" >&2; exit 2; }
if [ -f "$DIR/.installed" ] && [ "$(cat "$DIR/.installed")" = "$WANT" ]; then
    echo "compat: $DIR is up to date ($WANT)"; exit 0
fi
rm -rf "$DIR.tmp"
"$BASE/bin/python" -m venv --without-pip "$DIR.tmp"
site=$("$DIR.tmp/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
base_site=$("$BASE/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
flags=()
if ! "$BASE/bin/python" -c 'import sys; sys.exit(sys.version_info < (3, 12))'; then
    flags+=(--ignore-requires-python)  # Python < 3.12 with a cp311 wheel: see the header
fi
"$BASE/bin/python" -m pip install -q --no-deps "${flags[@]}" --target "$site" \
    "megatron-core==$VERSION" "triton==$TRITON"
# Behind this venv's own packages: the locked set (and its .pth files: the editable megatron_flash).
echo "import site; site.addsitedir('$(readlink -f "$base_site")')" > "$site/zz-locked-venv.pth"
got=$("$DIR.tmp/bin/python" -c 'from importlib.metadata import version; print(version("megatron-core"))')
[ "$got" = "$VERSION" ] || { echo "compat: $DIR.tmp imports megatron-core $got, not $VERSION" >&2; exit 1; }
echo "$WANT" > "$DIR.tmp/.installed"
rm -rf "$DIR"
mv "$DIR.tmp" "$DIR"
echo "compat: $DIR ready (megatron-core $VERSION, triton $TRITON${flags:+, ${flags[*]}})"
