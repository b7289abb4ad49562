"""A real Slurm cluster of N hosts on this machine, to run launch/slurm/*.sbatch before a real cluster.

    sudo python3 tools/cluster/cluster.py up 3      # 3 hosts: mf-node1 (slurmctld + slurmd) .. mf-node3
    sudo python3 tools/cluster/cluster.py status    # hosts, daemons, sinfo
    eval "$(python3 tools/cluster/cluster.py env)"  # SLURM_CONF for sbatch / squeue / scontrol / scancel
    sudo python3 tools/cluster/cluster.py down      # no daemon, namespace, link or /etc/hosts line left

Each host is a network namespace on one bridge, with its own address and hostname:

    this machine (submit host, 10.213.0.254) ── bridge mfbr0 ──┬── mf-node1 10.213.0.1  slurmctld, slurmd
                                                               ├── mf-node2 10.213.0.2  slurmd
                                                               └── mf-node3 10.213.0.3  slurmd

The hosts share this machine's filesystem (the checkout, the model, checkpoints: a cluster's shared
filesystem), except /tmp, which is each host's own (/var/lib/mf-cluster/tmp/<host>): `up` refuses a
checkout, MODEL_PATH or LOG_DIR under /tmp (exit 2), and the templates refuse theirs
on this cluster (launch/slurm/common.sh `mf_shared_paths`), and one munged
(its socket is on that filesystem). The namespaces have no route off the bridge: a job reaches only
its peers and the submit host. Daemons enter a host with `nsenter --net` on the namespace's
file plus `unshare --uts` for its hostname: `ip netns exec` remounts /sys, which hides the machine's
cgroup v1 mounts, and slurmd then refuses to start. The Slurm packages come from
tools/cluster/install.sh (Debian's slurmctld, slurmd, slurm-client, munge).

`up` is idempotent (a running cluster of the same size is kept; any other state is taken down
first); `down` ends every process in the hosts' namespaces (job steps included), then the daemons,
the namespaces, the bridge and the /etc/hosts lines, and removes the state folder.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time

STATE = os.environ.get("MF_CLUSTER_DIR", "/var/lib/mf-cluster")  # not under /tmp: each host has its own /tmp
CONF = os.path.join(STATE, "etc", "slurm.conf")
BRIDGE = "mfbr0"
SUBNET = "10.213.0"
SUBMIT_ADDR = f"{SUBNET}.254"
HOSTS_TAG = "# mf-cluster"
PREFIX = "mf-node"
MUNGE_SOCKET = "/run/munge/munge.socket.2"
MUNGE_PID = "/run/munge/munged.pid"
REQUIRED = ("ip", "nsenter", "unshare", "munged", "slurmctld", "slurmd", "sbatch", "sinfo")


class ClusterError(RuntimeError):
    """A step of up/down failed; the message names the step and what it ran."""


def host_names(n: int) -> list[str]:
    return [f"{PREFIX}{i}" for i in range(1, n + 1)]


def address(name: str) -> str:
    return f"{SUBNET}.{int(name[len(PREFIX):])}"


def run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise ClusterError(f"`{' '.join(cmd)}` exited {proc.returncode}: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def why_not() -> str | None:
    """One line saying why the cluster cannot run here, or None."""
    if os.geteuid() != 0:
        return "tools/cluster needs root (network namespaces, a bridge, /etc/hosts, Slurm's daemons): run it as root"
    missing = [c for c in REQUIRED if shutil.which(c) is None]
    if missing:
        return f"tools/cluster: {', '.join(missing)} not installed: run tools/cluster/install.sh (as root, apt-get)"
    probe = subprocess.run(["unshare", "--net", "--uts", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"tools/cluster: this machine does not allow network namespaces (unshare --net: {probe.stderr.strip()})"
    return None


CHECKOUT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def under_tmp(path: str) -> bool:
    real = os.path.realpath(path)
    return real == "/tmp" or real.startswith("/tmp/")


def tmp_refusal(env: dict[str, str] | os._Environ = os.environ, checkout: str = CHECKOUT) -> str | None:
    """One line naming what lies under /tmp, which each host has of its own (in_host binds it), so a
    job there could not see it; None when nothing does. The checkout, this tool's state folder, and
    MODEL_PATH and LOG_DIR when they are set for the templates."""
    paths = [("the checkout", checkout), ("MF_CLUSTER_DIR", STATE)]
    paths += [(name, env[name]) for name in ("MODEL_PATH", "LOG_DIR") if env.get(name)]
    for name, path in paths:
        if under_tmp(path):
            return (f"tools/cluster: {name} {path} is under /tmp, which each host of the cluster has of its own "
                    "(jobs would not see it): clone or move it outside /tmp, e.g. under /work or /var/lib")
    return None


def existing_hosts() -> list[str]:
    out = run("ip", "netns", "list", check=False).stdout
    names = [line.split()[0] for line in out.splitlines() if line.startswith(PREFIX)]
    return sorted(names, key=lambda s: int(s[len(PREFIX):]))


# ------------------------------------------------------------------------------------------ network
def net_up(names: list[str]) -> None:
    if run("ip", "link", "show", BRIDGE, check=False).returncode != 0:
        run("ip", "link", "add", BRIDGE, "type", "bridge")
    run("ip", "addr", "replace", f"{SUBMIT_ADDR}/24", "dev", BRIDGE)
    run("ip", "link", "set", BRIDGE, "up")
    for name in names:
        idx = name[len(PREFIX):]
        run("ip", "netns", "add", name)
        run("ip", "link", "add", f"mfv{idx}", "type", "veth", "peer", "name", f"mfp{idx}")
        run("ip", "link", "set", f"mfp{idx}", "netns", name)
        run("ip", "link", "set", f"mfv{idx}", "master", BRIDGE, "up")
        ns = ("ip", "-n", name)
        run(*ns, "link", "set", f"mfp{idx}", "name", "eth0")
        run(*ns, "addr", "add", f"{address(name)}/24", "dev", "eth0")
        run(*ns, "link", "set", "lo", "up")
        run(*ns, "link", "set", "eth0", "up")
    # No default route in the hosts: nothing a job sends can leave the bridge.


def hosts_file_set(names: list[str]) -> None:
    hosts_file_clear()
    lines = [f"{SUBMIT_ADDR}\tmf-submit {HOSTS_TAG}\n"] + [f"{address(n)}\t{n} {HOSTS_TAG}\n" for n in names]
    with open("/etc/hosts", "a") as f:
        f.writelines(lines)


def hosts_file_clear() -> None:
    with open("/etc/hosts") as f:
        lines = f.readlines()
    kept = [line for line in lines if not line.rstrip().endswith(HOSTS_TAG)]
    if kept != lines:
        # Rewrite in place: /etc/hosts may be a bind mount, which a rename would not replace.
        with open("/etc/hosts", "w") as f:
            f.writelines(kept)


# ------------------------------------------------------------------------------------------ daemons
def in_host(name: str, *cmd: str) -> list[str]:
    """`cmd` on host `name`: its network namespace, its hostname (a new UTS namespace) and its own /tmp
    (a new mount namespace with a bind mount: node-local, as on a cluster, where two hosts' files in
    /tmp, e.g. the templates' torchrun pid files, never meet)."""
    script = 'hostname "$0" && mount --bind "$1" /tmp && shift && exec "$@"'
    return ["nsenter", f"--net=/run/netns/{name}", "unshare", "--uts", "--mount", "sh", "-c", script, name,
            os.path.join(STATE, "tmp", name), *cmd]


def munge_ok() -> bool:
    if not os.path.exists(MUNGE_SOCKET):
        return False
    enc = subprocess.run(["munge", "-n"], capture_output=True)
    return enc.returncode == 0 and subprocess.run(["unmunge"], input=enc.stdout, capture_output=True).returncode == 0


def munge_up() -> None:
    if munge_ok():
        return
    os.makedirs("/run/munge", exist_ok=True)
    shutil.chown("/run/munge", "munge", "munge")
    if not os.path.exists("/etc/munge/munge.key"):
        run("mungekey", "--create")
        shutil.chown("/etc/munge/munge.key", "munge", "munge")
    run("runuser", "-u", "munge", "--", "munged")
    with open(os.path.join(STATE, "munged.ours"), "w") as f:
        f.write("started by tools/cluster: down stops it\n")
    wait_for("munged answers", munge_ok, timeout_s=10)


def write_config(names: list[str]) -> None:
    for sub in ("etc", "state", "log", "run", *(f"spool/{n}" for n in names)):
        os.makedirs(os.path.join(STATE, sub), exist_ok=True)
    for name in names:
        os.makedirs(os.path.join(STATE, "tmp", name), exist_ok=True)
        os.chmod(os.path.join(STATE, "tmp", name), 0o1777)
    first = names[0]
    conf = f"""# Written by tools/cluster/cluster.py: {len(names)} hosts, network namespaces on bridge {BRIDGE}
ClusterName=mfcluster
SlurmctldHost={first}({address(first)})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# A requeued job waits cred_expire + 1 s before it starts again (Slurm's default: 120 s); short here
# so that requeue tests fit CI.
AuthInfo=cred_expire=10
CredType=cred/munge
StateSaveLocation={STATE}/state
SlurmdSpoolDir={STATE}/spool/%n
SlurmdPidFile={STATE}/run/slurmd-%n.pid
SlurmdLogFile={STATE}/log/slurmd-%n.log
SlurmctldPidFile={STATE}/run/slurmctld.pid
SlurmctldLogFile={STATE}/log/slurmctld.log
SlurmctldPort=6817
SlurmdPort=6818
# No cgroups for tasks: the hosts share one kernel and its cgroup v1 tree (cgroup.conf says which).
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
MpiDefault=none
ReturnToService=2
JobRequeue=1
# A host whose link is cut for a test stays in the job: slurmctld marks it down only after this long.
SlurmdTimeout=300
SlurmctldTimeout=60
InactiveLimit=0
# Job steps get SIGTERM, then SIGKILL this many seconds later (Slurm's default: 30).
KillWait=10
MinJobAge=600
SchedulerParameters=defer_batch=0
NodeName={PREFIX}[1-{len(names)}] CPUs={os.cpu_count() or 1} RealMemory=1000 State=UNKNOWN
PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""
    with open(CONF, "w") as f:
        f.write(conf)
    with open(os.path.join(STATE, "etc", "cgroup.conf"), "w") as f:
        f.write("CgroupPlugin=cgroup/v1\nCgroupAutomount=no\n")


def daemon_env() -> dict[str, str]:
    return {**os.environ, "SLURM_CONF": CONF}


def slurm_up(names: list[str]) -> None:
    env = daemon_env()
    first = names[0]
    subprocess.run(in_host(first, "slurmctld", "-f", CONF), env=env, check=True, capture_output=True)
    for name in names:
        proc = subprocess.run(in_host(name, "slurmd", "-f", CONF, "-N", name), env=env, capture_output=True,
                              text=True)
        if proc.returncode != 0:
            raise ClusterError(f"slurmd on {name} did not start ({proc.stderr.strip()}); log: {log_tail(name)}")
    wait_for(f"sinfo shows {len(names)} idle nodes", lambda: idle_count() == len(names), timeout_s=60,
             on_timeout=lambda: f"sinfo: {sinfo()}; slurmctld log: {log_tail('slurmctld')}")


def log_tail(name: str, lines: int = 5) -> str:
    path = os.path.join(STATE, "log", "slurmctld.log" if name == "slurmctld" else f"slurmd-{name}.log")
    try:
        with open(path) as f:
            return " | ".join(line.strip() for line in f.readlines()[-lines:])
    except OSError:
        return f"(no {path})"


def sinfo() -> str:
    proc = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], env=daemon_env(), capture_output=True, text=True,
                          timeout=15)
    return proc.stdout.strip() if proc.returncode == 0 else f"sinfo failed: {proc.stderr.strip()}"


def idle_count() -> int:
    return sum(1 for line in sinfo().splitlines() if line.endswith(" idle"))


def wait_for(what: str, ok, *, timeout_s: float, on_timeout=None) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if ok():
                return
        except (subprocess.SubprocessError, OSError):
            pass
        if time.monotonic() > deadline:
            extra = f"; {on_timeout()}" if on_timeout else ""
            raise ClusterError(f"timed out after {timeout_s:.0f} s waiting until {what}{extra}")
        time.sleep(0.5)


# ------------------------------------------------------------------------------------------ commands
def up(n: int) -> None:
    if n < 1:
        raise ClusterError(f"up N needs N >= 1, got {n}")
    names = host_names(n)
    if existing_hosts() == names and idle_or_busy(names) and munge_ok():
        print(f"cluster up: {n} hosts already running ({' '.join(names)})")
        return
    if existing_hosts() or os.path.exists(STATE):
        down(quiet=True)
    os.makedirs(STATE, exist_ok=True)
    started = time.monotonic()
    try:
        net_up(names)
        hosts_file_set(names)
        munge_up()
        write_config(names)
        slurm_up(names)
    except BaseException:
        down(quiet=True)
        raise
    print(f"cluster up: {n} hosts in {time.monotonic() - started:.1f} s: "
          + ", ".join(f"{h} {address(h)}" for h in names))
    print(f"submit from this machine with SLURM_CONF={CONF} (eval \"$(python3 {sys.argv[0]} env)\")")


def idle_or_busy(names: list[str]) -> bool:
    try:
        states = sinfo().splitlines()
    except subprocess.SubprocessError:
        return False
    ok = ("idle", "mixed", "allocated", "completing")
    return len(states) == len(names) and all(line.split()[-1].rstrip("*~#") in ok for line in states)


def stale_veths() -> list[str]:
    """Root-side veth ends (mfv<i>) still present."""
    out = run("ip", "-o", "link", "show", check=False).stdout
    return [f.split("@")[0] for f in (line.split(": ")[1] for line in out.splitlines() if ": " in line)
            if f.startswith("mfv")]


def pids_in(name: str) -> list[int]:
    out = run("ip", "netns", "pids", name, check=False).stdout
    return [int(p) for p in out.split()]


def kill_all(pids: list[int], *, grace_s: float) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(os.path.exists(f"/proc/{p}") for p in pids):
            time.sleep(0.2)
        pids = [p for p in pids if os.path.exists(f"/proc/{p}")]
        if not pids:
            return


def down(*, quiet: bool = False) -> None:
    hosts = existing_hosts()
    # Every process in a host's namespace is the cluster's: daemons, slurmstepd, job steps.
    kill_all([p for h in hosts for p in pids_in(h)], grace_s=3)
    for name in hosts:
        run("ip", "netns", "del", name, check=False)  # its veth end goes with it, and the pair with that
    # The kernel dismantles a deleted namespace asynchronously: its veth pair lingers for a moment (an
    # `up` right after `down` then found "File exists"). Wait for it; delete what is left after that.
    deadline = time.monotonic() + 10
    while stale_veths() and time.monotonic() < deadline:
        time.sleep(0.2)
    for link in stale_veths():
        run("ip", "link", "del", link, check=False)
    if run("ip", "link", "show", BRIDGE, check=False).returncode == 0:
        run("ip", "link", "del", BRIDGE, check=False)
    hosts_file_clear()
    if os.path.exists(os.path.join(STATE, "munged.ours")) and os.path.exists(MUNGE_PID):
        with open(MUNGE_PID) as f:
            kill_all([int(f.read().strip())], grace_s=5)
    shutil.rmtree(STATE, ignore_errors=True)
    if not quiet:
        print(f"cluster down: {len(hosts)} host(s) removed" if hosts else "cluster down: nothing was running")


def status() -> int:
    hosts = existing_hosts()
    if not hosts:
        print("cluster: not running (tools/cluster/cluster.py up N)")
        return 1
    print(f"cluster: {len(hosts)} hosts; SLURM_CONF={CONF}; munged {'ok' if munge_ok() else 'NOT answering'}")
    for h in hosts:
        print(f"  {h} {address(h)}  processes: {len(pids_in(h))}")
    print(sinfo())
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("up").add_argument("n", type=int, nargs="?", default=3, help="number of hosts (3)")
    sub.add_parser("down")
    sub.add_parser("status")
    sub.add_parser("env", help="print `export SLURM_CONF=...` for the Slurm commands")
    args = p.parse_args()
    if args.cmd == "env":
        print(f"export SLURM_CONF={CONF}")
        return 0
    refusal = tmp_refusal() if args.cmd == "up" else None
    if refusal:
        print(refusal, file=sys.stderr)
        return 2
    reason = why_not()
    if reason:
        print(reason, file=sys.stderr)
        return 3
    try:
        if args.cmd == "up":
            up(args.n)
        elif args.cmd == "down":
            down()
        else:
            return status()
    except ClusterError as exc:
        print(f"tools/cluster {args.cmd}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
