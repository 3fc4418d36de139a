"""nan_guard beyond ddp (issue 22, item 7): fsdp (FSDP2), deepspeed (ZeRO stage 2) and the
pipeline, each on 2 real processes (gloo, CPU).

Rank 1's loss is NaN at one step (under the pipeline: the last stage's, on rank 1). With
``action="skip"`` every rank must end with the weights of a hand-written loop that drops
that step's update (and only that one: DeepSpeed must not carry the NaN gradients into
the next step); with ``action="stop"`` both ranks stop at that step with the weights of the
steps before it. This file is also the worker: ``hookloop run --plugins PLUGIN --devices 2
tests/test_nan_guard_strategies.py OUT`` runs both modes and writes ``OUT/rank<R>.pt``.

All three run under make test-full: a 2-process launch of each takes
45-75 s on the 2-core CI machine, over the default tier's budget.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from torch.nn import functional as F

STEPS, NAN_AT, LR, MOMENTUM = 6, 2, 0.1, 0.9


def net() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU()),
                               torch.nn.Sequential(torch.nn.Linear(16, 3)))


def make_optimizer(name: str, params):
    if name == "adam":
        return torch.optim.Adam(params, lr=0.01)
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)


def reference(batches_per_step: list[list[tuple]], skip: int | None, steps: int, optimizer: str = "sgd") -> dict:
    """SGD (momentum) on the same model in one process: each step's gradient is the mean
    over the ranks' batches of the step (data parallel) or of the one batch (the
    pipeline), without the update of step ``skip``."""
    model = net()
    optimizer = make_optimizer(optimizer, model.parameters())
    for step in range(steps):
        optimizer.zero_grad()
        batches = batches_per_step[step]
        for x, y in batches:
            (F.cross_entropy(model(x), y) / len(batches)).backward()
        if step != skip:
            optimizer.step()
    return {f"blocks.{k}": v for k, v in model.state_dict().items()}


# ---------------------------------------------------------------------------------------
# the tests
# ---------------------------------------------------------------------------------------

if __name__ != "__main__":
    import pytest

    from conftest import run_python

    FULL = pytest.mark.full  # a 2-process run per strategy

    def _run(tmp_path, plugin: str, runs: list[dict]) -> tuple[dict, str]:
        proc = run_python([sys.executable, "-m", "hookloop", "run", "--plugins", plugin, "--devices", "2",
                           str(Path(__file__).resolve()), str(tmp_path), json.dumps(runs)], cwd=tmp_path, timeout=300)
        ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
        return {run["name"]: [record[run["name"]] for record in ranks] for run in runs}, proc.stdout

    def _check(ranks: list[dict], stdout: str, pipeline: bool = False, optimizer: str = "sgd") -> None:
        # what each step trained on: both ranks' batches (data parallel) or the one batch
        if pipeline:
            assert [b[0].tolist() for b in ranks[0]["skip"]["batches"]] == [b[0].tolist() for b in ranks[1]["skip"]["batches"]]
            steps = [[b] for b in ranks[0]["skip"]["batches"]]
        else:
            steps = [[r["skip"]["batches"][s] for r in ranks] for s in range(STEPS)]
        skipped = reference(steps, skip=NAN_AT, steps=STEPS, optimizer=optimizer)
        stopped = reference(steps, skip=None, steps=NAN_AT, optimizer=optimizer)  # the steps before the bad one
        for rank, record in enumerate(ranks):
            skip, stop = record["skip"], record["stop"]
            assert skip["global_step"] == STEPS and skip["skipped"] == 1, (rank, skip["global_step"], skip["skipped"])
            assert [(s, what, r) for s, what, r, _ in skip["events"]] == [(NAN_AT, "a non-finite value", 1)]
            for name, expected in (("skip", skipped), ("stop", stopped)):
                weights = record[name]["weights"]
                assert weights.keys() == expected.keys()
                for key, value in expected.items():
                    torch.testing.assert_close(weights[key], value, rtol=0, atol=1e-6, msg=f"{name} {key} rank {rank}")
            assert stop["global_step"] == NAN_AT + 1  # the bad step counts, its update is not applied
            assert [(s, r) for s, _, r, _ in stop["events"]] == [(NAN_AT, 1)]
        assert stdout.count(f"skipped the update of global step {NAN_AT} on every rank") >= 1
        assert stdout.count(f"nan_guard: stopping at global step {NAN_AT}: a non-finite value on global rank 1") >= 1

    @FULL
    def test_nan_guard_under_deepspeed_drops_exactly_the_bad_update_in_the_engine(tmp_path):
        # DeepSpeed's engine keeps the gradients until engine.step(): a step nan_guard
        # skips must drop them there, or the next window adds its gradients to the NaN ones
        runs = [{"name": "stage0", "options": {"deepspeed": {"stage": 0}}},
                {"name": "stage2", "options": {"deepspeed": {"stage": 2}}},
                {"name": "stage3", "options": {"deepspeed": {"stage": 3}}, "expect_error": True}]
        results, stdout = _run(tmp_path, "deepspeed", runs)
        for name in ("stage0", "stage2"):
            _check(results[name], stdout)
        for record in results["stage2"]:
            assert record["skip"]["engine_skipped_steps"] == 1  # DeepSpeed's own overflow path dropped them
        for record in results["stage3"]:
            assert record["error"].startswith("nan_guard(action='skip') under DeepSpeed needs a skipped step's "
                                              "gradients dropped in the engine"), record["error"]
            assert "ZeRO stage 3" in record["error"] and "use nan_guard(action='stop'), or ZeRO stage 1 or 2" in record["error"]

    @FULL
    def test_nan_guard_under_fsdp_matches_the_hand_written_loop_in_the_full_state_dict(tmp_path):
        # check_grad_norm: each rank reads its own shards (DTensor.to_local); the agreement does the rest
        results, stdout = _run(tmp_path, "fsdp", [{"name": "fsdp", "check_grad_norm": True}])
        ranks = results["fsdp"]
        _check(ranks, stdout)
        for record in ranks:  # the sharded weights, gathered while fit ran, agree too
            for name in ("skip", "stop"):
                for key, value in record[name]["weights"].items():
                    torch.testing.assert_close(record[name]["sharded_full"][key], value, rtol=0, atol=1e-6)

    @FULL
    def test_nan_guard_under_the_pipeline_acts_on_every_stage_at_the_last_stages_nan(tmp_path):
        results, stdout = _run(tmp_path, "pipeline", [{"name": "pipeline"}])
        _check(results["pipeline"], stdout, pipeline=True)


# ---------------------------------------------------------------------------------------
# the worker (one strategy: skip, then stop)
# ---------------------------------------------------------------------------------------

if __name__ == "__main__":
    import faulthandler

    import torch.distributed as dist
    from torch.utils.data import DataLoader

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import hookloop  # noqa: E402
    from conftest import tiny_data  # noqa: E402

    faulthandler.enable()
    faulthandler.dump_traceback_later(240, exit=True)
    torch.set_num_threads(1)
    OUT, RUNS = Path(sys.argv[1]), json.loads(sys.argv[2])
    OPTIMIZER = "sgd"
    RANK = int(os.environ["RANK"])

    class Net(hookloop.Module):
        def __init__(self):
            super().__init__()
            self.blocks = net()

        def forward(self, x):
            return self.blocks(x)

        def pipeline_loss(self, output, target):  # the pipeline's: on the last stage (rank 1)
            loss = F.cross_entropy(output, target)
            return loss * float("nan") if self.trainer.global_step == NAN_AT else loss

        def training_step(self, batch, batch_idx):  # data parallel: rank 1's loss is NaN
            x, y = batch
            loss = F.cross_entropy(self(x), y)
            return loss * float("nan") if self.trainer.global_step == NAN_AT and RANK == 1 else loss

        def configure_optimizers(self):
            return make_optimizer(OPTIMIZER, self.parameters())

    class Probe:
        """The batches trained on, and (fsdp) the full state dict of the sharded weights at
        the end of training."""

        hookloop_name, hookloop_role = "probe", "observer"

        def __init__(self):
            self.batches, self.sharded_full, self.engine_skipped = [], None, None

        @hookloop.hookimpl
        def on_train_batch_start(self, trainer, batch, batch_idx):
            self.batches.append(tuple(t.clone() for t in batch))

        @hookloop.hookimpl
        def on_train_end(self, trainer):
            if any(hasattr(p, "placements") for p in trainer.module.parameters()):  # FSDP2's DTensors
                from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

                state = get_model_state_dict(trainer.module, options=StateDictOptions(full_state_dict=True))
                self.sharded_full = {k: v.detach().clone() for k, v in state.items()}
            engine = getattr(trainer.strategy, "engine", None)
            if engine is not None:
                self.engine_skipped = int(engine.skipped_steps)

    record: dict = {}
    for run in RUNS:
        OPTIMIZER = run.get("optimizer", "sgd")
        record[run["name"]] = result = {}
        for action in ("skip",) if run.get("expect_error") else ("skip", "stop"):
            guard = hookloop.NanGuard(action=action, check_grad_norm=run.get("check_grad_norm", False))
            probe, module = Probe(), Net()
            trainer = hookloop.Trainer(default_root_dir=str(OUT / run["name"] / action), max_steps=STEPS,
                                       callbacks=[guard, probe], plugin_options=run.get("options", {}), logger=False,
                                       enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
            try:
                trainer.fit(module, DataLoader(tiny_data(64), batch_size=8))
            except hookloop.ConfigurationError as exc:
                if not run.get("expect_error"):
                    raise
                result["error"] = str(exc)
                continue
            result[action] = {"weights": {k: v.detach().float().clone() for k, v in module.state_dict().items()},
                              "global_step": trainer.global_step, "events": guard.events,
                              "skipped": guard.skipped_steps, "batches": probe.batches,
                              "sharded_full": probe.sharded_full, "engine_skipped_steps": probe.engine_skipped}
    torch.save(record, OUT / f"rank{RANK}.pt")
    if dist.is_initialized():
        dist.destroy_process_group()
