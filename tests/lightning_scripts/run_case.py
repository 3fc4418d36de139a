"""Prepare and run one case under one framework; what it computed goes to a JSON file.

    python -m tests.lightning_scripts.run_case CASE FRAMEWORK WORKDIR OUT_PREFIX   (one rank)

`prepare` writes into WORKDIR: ``pkgs/lightning_demos/`` (the vendored demos, imports
rewritten for the framework), ``case.py`` (the case's source, rewritten the same way) and
the local data the source reads. `launch` runs this module in WORKDIR, in one process or
under ``torchrun --standalone --nproc-per-node 2``.

What is observed, without touching the script: the framework's ``Trainer`` class gets its
``fit``/``validate``/``test``/``predict`` wrapped (on the class, for the run's duration) so
that each call records, after it returns, the trainer's ``global_step``, ``current_epoch``,
``callback_metrics`` and a checksum of the model's parameters. Each rank writes
``OUT_PREFIX.rank<R>.json`` with those records and how the case ended.
"""

from __future__ import annotations

import functools
import json
import os
import random
import runpy
import subprocess
import sys
import traceback
from pathlib import Path

from . import data
from .cases import BY_NAME, VENDOR, Case
from .rewrite import rewrite

REPO = Path(__file__).resolve().parents[2]
METHODS = ("fit", "validate", "test", "predict")


def prepare(case: Case, framework: str, workdir: Path) -> None:
    pkg = workdir / "pkgs" / "lightning_demos"
    pkg.mkdir(parents=True, exist_ok=True)
    for src in (VENDOR / "lightning_demos").glob("*.py"):
        (pkg / src.name).write_text(rewrite(src.read_text(), framework))
    (workdir / "case.py").write_text(rewrite((VENDOR / case.vendored).read_text(), framework))
    for name in case.data:
        getattr(data, name)(workdir)


def environment(framework: str, ddp: bool) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env["PL_DISABLE_FORK"] = "1"
    # One intra-op thread per process, in both frameworks: on a shared machine torch's
    # default (one per core) spins against other processes (measured: 3 s per step of the
    # demo Transformer instead of 0.1 s).
    env["OMP_NUM_THREADS"] = "1"
    env.pop("HOOKLOOP_TRAINER_DEFAULTS", None)
    for key in [k for k in env if k.startswith("PL_TRAINER_")]:
        del env[key]
    if ddp:
        if framework == "lightning":
            env.update(PL_TRAINER_ACCELERATOR="cpu", PL_TRAINER_DEVICES="2", PL_TRAINER_STRATEGY="ddp")
        else:
            env["HOOKLOOP_TRAINER_DEFAULTS"] = json.dumps({"plugins": ["ddp"], "devices": 2, "accelerator": "cpu"})
            # as `hookloop run` hands it over: to the processes it started (this one is their launcher)
            env["HOOKLOOP_LAUNCHER_PID"] = str(os.getpid())
    return env


def launch(case: Case, framework: str, workdir: Path, ddp: bool, timeout: float = 300) -> dict:
    """Prepare WORKDIR, run the case, return {"returncode", "output", "ranks": [json...]}."""
    workdir.mkdir(parents=True, exist_ok=True)
    prepare(case, framework, workdir)
    prefix = workdir / "result"
    module = ["-m", "tests.lightning_scripts.run_case", case.name, framework, str(workdir), str(prefix)]
    if ddp:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *module]
    else:
        cmd = [sys.executable, *module]
    if ddp and case.ddp == "args":
        cmd += ["--", *case.ddp_args]
    try:
        proc = subprocess.run(cmd, cwd=workdir, env=environment(framework, ddp), capture_output=True, text=True,
                              timeout=timeout)
        returncode, output = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        returncode, output = "timeout", f"timed out after {timeout:.0f} s\n" + str(exc.stdout or "")[-2000:]
    ranks = []
    for rank in range(2 if ddp else 1):
        path = Path(f"{prefix}.rank{rank}.json")
        ranks.append(json.loads(path.read_text()) if path.is_file() else None)
    return {"returncode": returncode, "output": output, "ranks": ranks}


# ---------------------------------------------------------------- inside the run


def _checksum(model) -> list[float] | None:
    params = list(getattr(model, "parameters", lambda: [])())
    if not params:
        return None
    return [float(sum(p.detach().double().sum() for p in params)),
            float(sum(p.detach().double().abs().sum() for p in params))]


def _metrics(trainer) -> dict:
    out = {}
    for k, v in dict(getattr(trainer, "callback_metrics", {}) or {}).items():
        try:
            out[k] = float(v.item() if hasattr(v, "item") else v)
        except (TypeError, ValueError):
            out[k] = repr(v)
    return out


def _record(records: list, trainer_cls) -> list:
    """Wrap ``trainer_cls``'s run methods so that each call appends what it computed."""
    originals = {}
    depth = [0]
    last_model = {}

    for name in METHODS:
        original = getattr(trainer_cls, name)
        originals[name] = original

        def make(name, original):
            @functools.wraps(original)
            def wrapper(self, *args, **kwargs):
                model = args[0] if args else kwargs.get("model")
                if model is not None:
                    last_model[id(self)] = model
                depth[0] += 1
                error = None
                try:
                    return original(self, *args, **kwargs)
                except BaseException as exc:
                    error = f"{type(exc).__name__}: {exc}"
                    raise
                finally:
                    depth[0] -= 1
                    if depth[0] == 0:  # the user's call, not one the framework makes inside it
                        records.append({
                            "call": name, "error": error,
                            "global_step": int(getattr(self, "global_step", -1)),
                            "current_epoch": int(getattr(self, "current_epoch", -1)),
                            "metrics": _metrics(self),
                            "weights": _checksum(last_model.get(id(self))),
                        })

            return wrapper

        setattr(trainer_cls, name, make(name, original))
    return originals


def _trainer_class(framework: str):
    if framework == "lightning":
        import pytorch_lightning

        return pytorch_lightning.Trainer
    import hookloop

    return hookloop.Trainer


def main(argv: list[str]) -> None:
    name, framework, workdir, prefix, *rest = argv
    if rest[:1] == ["--"]:
        rest = rest[1:]
    case = BY_NAME[name]
    rank = int(os.environ.get("RANK", "0"))
    sys.path.insert(0, str(Path(workdir) / "pkgs"))
    sys.path.insert(0, str(workdir))
    import numpy as np
    import torch

    # Equal seeds: the same global RNG state before the case's first line, in both frameworks.
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    records: list = []
    result = {"case": name, "framework": framework, "rank": rank, "records": records, "error": None}
    try:
        _record(records, _trainer_class(framework))
        script = str(Path(workdir) / "case.py")
        if case.kind == "script":
            sys.argv = [script, *case.argv, *rest]
            runpy.run_path(script, run_name="__main__")
        else:
            namespace = runpy.run_path(script, run_name="lightning_case")
            tmp = Path(workdir) / "tmp_path"
            tmp.mkdir(exist_ok=True)
            namespace[case.function](tmp_path=tmp, **case.kwargs)
    except SystemExit as exc:
        if exc.code not in (0, None):
            result["error"] = f"SystemExit: {exc.code}"
    except BaseException as exc:  # noqa: BLE001 - the table reports it
        result["error"] = f"{type(exc).__name__}: {exc}"
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename.endswith("case.py")]
        if frames and frames[-1].line:  # which of the case's lines failed (a bare assert says nothing)
            result["error"] += f" (case.py:{frames[-1].lineno}: `{frames[-1].line}`)"
        result["traceback"] = traceback.format_exc()[-3000:]
    Path(f"{prefix}.rank{rank}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
