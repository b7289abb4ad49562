#!/bin/bash
# Install what tools/cluster/cluster.py needs: Slurm's controller, node daemon and client commands,
# munge (Slurm's authentication), iproute2 (namespaces, bridge, veth) and util-linux (nsenter,
# unshare), from the distribution's packages (Debian 12: Slurm 22.05). Does nothing when all are
# present, so `make test-cluster` can call it every time.
set -euo pipefail
need=()
for pair in slurmctld:slurmctld slurmd:slurmd sbatch:slurm-client munged:munge ip:iproute2 \
            nsenter:util-linux curl:curl; do
    command -v "${pair%%:*}" >/dev/null 2>&1 || need+=("${pair#*:}")
done
((${#need[@]})) || exit 0
if [[ $(id -u) != 0 ]]; then
    echo "tools/cluster/install.sh: needs root to install ${need[*]} (apt-get)" >&2
    exit 1
fi
command -v apt-get >/dev/null || { echo "tools/cluster/install.sh: no apt-get; install ${need[*]} by hand" >&2; exit 1; }
echo "tools/cluster/install.sh: apt-get install ${need[*]}"
export DEBIAN_FRONTEND=noninteractive
# Debian's postinst scripts would start the daemons with systemd or init scripts: the mini-cluster
# starts its own, inside the namespaces, so keep the packages' services from starting.
policy=/usr/sbin/policy-rc.d
created_policy=0
if [[ ! -e $policy ]]; then printf '#!/bin/sh\nexit 101\n' > "$policy"; chmod +x "$policy"; created_policy=1; fi
trap 'if ((created_policy)); then rm -f "$policy"; fi' EXIT
apt-get install -y -q --no-install-recommends "${need[@]}" >/dev/null || {
    apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends "${need[@]}" >/dev/null; }
