"""SLURM node lists: the rendezvous host is the first host as SLURM itself expands the list.

Expected expansions are written out by hand from SLURM's documented hostlist forms. The one
stand-in here is ``scontrol``: SLURM is not installed, so a tiny shell script of that name
on PATH plays the part of the real command.
"""

from __future__ import annotations

import os
import stat

import pytest

import hookloop
from hookloop_ddp import ClusterEnvironment
from hookloop_ddp import environment


@pytest.fixture
def no_scontrol(tmp_path, monkeypatch):
    """A PATH with no ``scontrol`` on it, so the parser is what answers."""
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))


def fake_scontrol(directory, body):
    """Write an executable ``scontrol`` shell script into ``directory``."""
    directory.mkdir(exist_ok=True)
    script = directory / "scontrol"
    script.write_text("#!/bin/sh\n" + body)
    script.chmod(script.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return script


@pytest.mark.parametrize("nodelist,hosts", [
    ("node1", ["node1"]),
    ("a,b,c", ["a", "b", "c"]),
    ("node[1-3,7]", ["node1", "node2", "node3", "node7"]),
    ("node[007-010]", ["node007", "node008", "node009", "node010"]),
    ("node[9-11]", ["node9", "node10", "node11"]),
    ("n[1-3]-ib", ["n1-ib", "n2-ib", "n3-ib"]),
    ("rack[1-2]-node[01-02]", ["rack1-node01", "rack1-node02", "rack2-node01", "rack2-node02"]),
    ("gpu[1-2],cpu[3,5]", ["gpu1", "gpu2", "cpu3", "cpu5"]),
    ("node[5]", ["node5"]),
    ("x-1,y", ["x-1", "y"]),
    ("a[09,11-12],b2", ["a09", "a11", "a12", "b2"]),
    ("10.0.0.1", ["10.0.0.1"]),
])
def test_expand_hostlist_documented_forms(nodelist, hosts):
    assert environment.expand_hostlist(nodelist) == hosts


@pytest.mark.parametrize("nodelist,why", [
    ("", "no host"),
    (" , ", "no host"),
    ("node[1-3", r"unbalanced '\['"),
    ("node1-3]", r"unbalanced '\]'"),
    ("node[[1-2]]", r"'\[' inside"),
    ("node[3-1]", "goes down"),
    ("node[]", "empty"),
    ("node[1,,2]", "empty"),
    ("node[a-c]", "not a number"),
    ("node[1-]", "not a number"),
])
def test_malformed_node_list_is_a_configuration_error_naming_list_and_variable(nodelist, why):
    with pytest.raises(hookloop.ConfigurationError, match=why) as info:
        environment.expand_hostlist(nodelist, variable="SLURM_NODELIST")
    assert f"SLURM_NODELIST={nodelist!r}" in str(info.value)
    assert "MASTER_ADDR" in str(info.value)  # the way around a list that cannot be read


def test_first_host_keeps_the_suffix_after_the_brackets(no_scontrol):
    assert environment.first_host("n[1-3]-ib") == "n1-ib"
    assert environment.first_host("rack[2-3]-node[07-09]") == "rack2-node07"


def test_first_host_checks_the_whole_list_not_only_the_first_name(no_scontrol):
    with pytest.raises(hookloop.ConfigurationError, match=r"SLURM_JOB_NODELIST='n1,m\[4-2\]'"):
        environment.first_host("n1,m[4-2]")


def test_first_host_uses_scontrol_where_it_exists(tmp_path, monkeypatch):
    calls = tmp_path / "calls"
    # Answers differ from the parser's on purpose, so the test sees whose answer was used.
    fake_scontrol(tmp_path / "bin", f'printf "%s\\n" "$@" > "{calls}"\nprintf "ib-n1\\nib-n2\\nib-n3\\n"\n')
    monkeypatch.setenv("PATH", str(tmp_path / "bin") + os.pathsep + os.environ["PATH"])
    assert environment.first_host("n[1-3]-ib") == "ib-n1"
    assert calls.read_text().splitlines() == ["show", "hostnames", "n[1-3]-ib"]


def test_first_host_falls_back_to_the_parser_when_scontrol_fails(tmp_path, monkeypatch):
    # scontrol exists on login nodes without a slurm.conf and then exits non-zero.
    fake_scontrol(tmp_path / "bin", 'echo "scontrol: error: resolve_ctls_from_dns_srv" >&2\nexit 1\n')
    monkeypatch.setenv("PATH", str(tmp_path / "bin") + os.pathsep + os.environ["PATH"])
    assert environment.first_host("n[1-3]-ib") == "n1-ib"


def slurm_job(monkeypatch, nodelist):
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SLURM_NODELIST", "SLURM_NTASKS_PER_NODE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in dict(SLURM_PROCID="3", SLURM_NTASKS="4", SLURM_LOCALID="0", SLURM_NODEID="2",
                           SLURM_JOB_NODELIST=nodelist, SLURM_JOB_ID="4242").items():
        monkeypatch.setenv(key, value)


def test_detect_under_slurm_rendezvous_at_the_first_host_with_its_suffix(no_scontrol, monkeypatch):
    slurm_job(monkeypatch, "n[1-3]-ib")
    assert ClusterEnvironment.detect() == ClusterEnvironment(4, 3, 0, 4, 2, "n1-ib", 10000 + 4242, "slurm")


def test_detect_under_slurm_refuses_a_malformed_node_list(no_scontrol, monkeypatch):
    slurm_job(monkeypatch, "n[1-3-ib")
    with pytest.raises(hookloop.ConfigurationError, match=r"SLURM_JOB_NODELIST='n\[1-3-ib'"):
        ClusterEnvironment.detect()
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.9")  # the documented way around it
    assert ClusterEnvironment.detect().master_addr == "10.0.0.9"
