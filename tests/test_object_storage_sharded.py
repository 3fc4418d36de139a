"""Sharded checkpoints on object storage (issue 37, item 2): fsdp's DCP shards and DeepSpeed's
ZeRO shards committed to a real S3-compatible server (moto, on 127.0.0.1) with the real client
(s3fs), with the protocol of single files (hookloop.resume.sharded_store).

The resume certificate's job runs under ``hookloop run --max-restarts 1`` with its root on
S3; rank 0 (the machine's uploader) is SIGKILLed half-way through the upload of step 6's
checkpoint directory: the restart resumes from the store's committed step 4, and every
rank's final weights, optimizer state and schedulers equal an uninterrupted run's, bit for bit.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess

import pytest
import torch

from hookloop.resume import storage
from hookloop.testing.conformance import ResumeConformance

CASES = {
    # case: (plugin, options, ModelCheckpoint(async_save=...), tier)
    "fsdp": ("fsdp", {"state_dict_type": "sharded"}, False, pytest.mark.slow),
    "fsdp-async": ("fsdp", {"state_dict_type": "sharded"}, True, pytest.mark.full),
    "deepspeed_stage_2": ("deepspeed_stage_2", {}, False, pytest.mark.full),
}


def _job(out, case: str, root: str, kills: list, env: dict) -> subprocess.Popen:
    class OnS3(ResumeConformance):
        epochs = 2

    OnS3.plugin, OnS3.options, async_save, _ = CASES[case]
    spec = OnS3._spec(out, kills)
    spec.write_text(json.dumps({**json.loads(spec.read_text()), "root": root, "async_save": async_save}))
    return subprocess.Popen(OnS3._command(out, spec, 1), cwd=out, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _equal(a, b, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


@pytest.mark.parametrize("case", [pytest.param(name, marks=case[-1]) for name, case in CASES.items()])
def test_a_sharded_checkpoint_killed_mid_upload_resumes_from_the_previous_commit(s3, tmp_path, case):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "HOOKLOOP_"))}
    env[storage.STAGING_ENV] = str(tmp_path / "staging")
    kill = {"kind": "upload", "rank": 0, "at": 6}
    jobs, logs = {}, {}
    for name, kills in (("straight", []), ("killed", [kill])):
        (tmp_path / name).mkdir()
        jobs[name] = _job(tmp_path / name, case, s3.url(name), kills, env)
    for name, proc in jobs.items():
        try:
            logs[name] = proc.communicate(timeout=900)[0]
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        assert proc.returncode == 0, f"{name} job failed:\n{logs.get(name, '')[-6000:]}"
    assert (tmp_path / "killed" / "killed.attempt0.json").exists(), logs["killed"][-4000:]
    # the restart found the committed step 4 on the store, not the half-uploaded step 6
    assert re.search(r"restart 1 of this run .*: resumed from \S+ at epoch \d+, global step 4\b", logs["killed"]), \
        logs["killed"][-4000:]
    for rank in range(2):
        straight = torch.load(tmp_path / "straight" / f"final.rank{rank}.pt", weights_only=False)
        killed = torch.load(tmp_path / "killed" / f"final.rank{rank}.pt", weights_only=False)
        assert (killed["attempt"], straight["attempt"]) == (1, 0)
        _equal({k: v for k, v in killed.items() if k != "attempt"},
               {k: v for k, v in straight.items() if k != "attempt"}, f"rank {rank}")
    # on the store: last.ckpt is a tree (the strategy's latest and its tag's shards), committed at step 8
    last = s3.url("killed", "logs", "version_0", "checkpoints", "last.ckpt")
    payload = storage.resolve(last)
    assert storage.name_of(payload).startswith("step8-"), payload
    names = storage.listdir(payload)
    assert "latest" in names and len(names) == 2, names
    shards = [k for k in s3.keys("killed", "logs", "version_0", "checkpoints") if "/last.ckpt/" in k]
    pattern = r"__\d+_0\.distcp$" if case.startswith("fsdp") else r"zero_pp_rank_\d+_mp_rank_00_optim_states\.pt$"
    assert len([k for k in shards if re.search(pattern, k)]) >= 2, shards  # every rank's shard
    # the store's committed checkpoints are the uninterrupted run's, each its marker and one tag;
    # the killed upload (epoch=1-step=6.ckpt, which the restart saved as -v1 beside its local copy
    # and pruned) is a tag without a marker: never read
    directories = {name: storage.join(s3.url(name), "logs", "version_0", "checkpoints") for name in jobs}
    committed = {}
    for name, directory in directories.items():
        committed[name] = {c: storage.listdir(storage.join(directory, c)) for c in storage.listdir(directory)}
        committed[name] = {c: tags for c, tags in committed[name].items() if "latest" in tags}
        assert all(len(tags) == 2 for tags in committed[name].values()), committed[name]
    assert committed["killed"].keys() == committed["straight"].keys()
    assert storage.resolve(storage.join(directories["killed"], "epoch=1-step=6.ckpt")) is None
