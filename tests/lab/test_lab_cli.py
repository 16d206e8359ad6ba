"""``pipemorph lab``: a lab that stays between commands, a lab for one job, and refusals (bad input,
no privilege) as one sentence with exit code 2 and nothing created."""
import shutil
import subprocess

import pytest

from ds_pipemorph.lab.names import lab_prefix
from lab_helpers import namespaces

DROP = ["setpriv", "--bounding-set=-sys_admin,-net_admin", "--inh-caps=-sys_admin,-net_admin"]


def pm(*args, prefix=()):
    return subprocess.run([*prefix, "pipemorph", "lab", *map(str, args)], capture_output=True, text=True, timeout=120)


def refused(res) -> str:
    assert res.returncode == 2, res
    assert "Traceback" not in res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    return lines[0]


@pytest.mark.timeout(120)
@pytest.mark.skipif(shutil.which("setpriv") is None, reason="setpriv (util-linux) is not installed")
@pytest.mark.parametrize("cmd", [["up", "--nodes", "2", "--name", "nopriv"],
                                 ["launch", "--nodes", "2", "--name", "nopriv", "--", "true"]])
def test_without_the_privilege_to_make_namespaces_one_sentence_and_nothing_created(cmd):
    # A real refusal: the kernel denies the mount and the links without CAP_SYS_ADMIN / CAP_NET_ADMIN.
    line = refused(pm(*cmd, prefix=DROP))
    assert "root" in line and "CAP_SYS_ADMIN" in line
    assert namespaces(lab_prefix("nopriv")) == []


@pytest.mark.alone  # `lab ls` lists every lab on the machine: no other test's may be there
@pytest.mark.timeout(300)
def test_a_lab_stays_between_commands_until_down(lab_capable):
    prefix = lab_prefix("clit")
    try:
        up = pm("up", "--nodes", 3, "--name", "clit")
        assert up.returncode == 0, up.stderr
        assert "198.18.0.3" in up.stdout and len(namespaces(prefix)) == 4
        refused(pm("up", "--nodes", 2, "--name", "clit"))  # the name is taken
        assert pm("shape", "clit", 2, 0, "25mbit", "--both").returncode == 0
        ls = pm("ls").stdout
        assert "2->0 net0 25mbit" in ls and "0->2 net0 25mbit" in ls and "1->0" not in ls
        assert pm("shape", "clit", 2, 0, "off").returncode == 0
        assert "2->0" not in pm("ls").stdout
        job = pm("run", "clit", 1, "--", "sh", "-c", "ip -o -4 addr show eth0; echo if=$GLOO_SOCKET_IFNAME; exit 7")
        assert job.returncode == 7 and "198.18.0.2/24" in job.stdout and "if=eth0" in job.stdout
        assert "bad rate" not in refused(pm("shape", "clit", 0, 1, "fast"))
        assert "node 3" in refused(pm("shape", "clit", 0, 3, "1gbit"))
        assert pm("link", "clit", 1, "down").returncode == 0
        state = pm("run", "clit", 1, "--", "ip", "-o", "link", "show", "eth0").stdout
        assert "state DOWN" in state
    finally:
        down = pm("down", "clit")
    assert down.returncode == 0 and namespaces(prefix) == []
    assert "no lab 'clit'" in refused(pm("shape", "clit", 0, 1, "1gbit"))


@pytest.mark.timeout(300)
def test_launch_runs_the_command_in_every_node_and_removes_the_lab(lab_capable, tmp_path):
    # Named labs: other labs may come and go on the machine meanwhile.
    res = pm("launch", "--nodes", 3, "--name", "clil", "--shape", "0=2:50mbit", "--logs", tmp_path, "--",
             "sh", "-c", "echo node {node} of {nodes} at {addr} master {master_addr} if $GLOO_SOCKET_IFNAME; "
                         "tc qdisc show dev {ifname} | grep -c htb; tc class show dev {ifname} | wc -l")
    assert res.returncode == 0, res.stderr
    logs = [(tmp_path / f"node{k}.log").read_text().split("\n") for k in range(3)]
    assert logs[1][0] == "node 1 of 3 at 198.18.0.2 master 198.18.0.1 if eth0"
    assert [log[2] for log in logs] == ["1", "0", "1"]  # shaped classes: 0 -> 2 and 2 -> 0 only
    assert namespaces(lab_prefix("clil")) == []

    failed = pm("launch", "--nodes", 2, "--name", "clif", "--", "sh", "-c", "[ {node} = 1 ] && exit 5; sleep 600")
    assert failed.returncode == 5 and namespaces(lab_prefix("clif")) == []
    for spec, words in (("0:1", "--shape '0:1'"), ("0-4:1gbit", "node 4"), ("0-1:quick", "rate")):
        assert words in refused(pm("launch", "--nodes", 2, "--name", "clib", "--shape", spec, "--", "true"))
        assert namespaces(lab_prefix("clib")) == []
