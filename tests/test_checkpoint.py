"""Checkpoints: bit-identical resume, atomic writes, safe loading, clear errors."""

import os

import pytest
import torch
from torch.utils.data import DataLoader

import hookloop
from conftest import TinyModule, state_of, tiny_data


def loader():
    return DataLoader(tiny_data(100), batch_size=16, shuffle=True)


def run(tmp_path, epochs, ckpt_path=None, module=None, **kw):
    module = module or TinyModule(scheduler=True)
    trainer = hookloop.Trainer(max_epochs=epochs, default_root_dir=str(tmp_path), **kw)
    trainer.fit(module, loader(), DataLoader(tiny_data(40, seed=5), batch_size=16), ckpt_path=ckpt_path)
    return module, trainer


def test_two_epochs_equal_one_plus_resume_plus_one_bit_identical(tmp_path):
    torch.manual_seed(123)
    straight, _ = run(tmp_path / "a", 2)

    torch.manual_seed(123)
    run(tmp_path / "b", 1)
    torch.manual_seed(999)  # whatever the RNG does in between must not matter
    resumed, trainer = run(tmp_path / "b", 2, ckpt_path="last", module=TinyModule(seed=42, scheduler=True))
    assert trainer.current_epoch == 2
    a, b = state_of(straight), state_of(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)
    # The optimizer's momentum and the scheduler travelled too.
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**2)


def test_mid_epoch_resume_bit_identical(tmp_path):
    torch.manual_seed(7)
    straight, _ = run(tmp_path / "a", 2)

    torch.manual_seed(7)
    _, t1 = run(tmp_path / "b", None, max_steps=10)  # 7 batches per epoch: stops in epoch 2
    assert (t1.current_epoch, t1.batch_idx) == (1, 3)
    ckpt = hookloop.safe_load(tmp_path / "b" / "logs" / "version_0" / "checkpoints" / "last.ckpt")
    assert {k: ckpt["loop"][k] for k in ("epoch", "global_step", "batch_idx", "stage")} == {
        "epoch": 1, "global_step": 10, "batch_idx": 3, "stage": "train"}
    torch.manual_seed(0)
    resumed, t2 = run(tmp_path / "b", 2, ckpt_path=tmp_path / "b" / "logs" / "version_0" / "checkpoints" / "last.ckpt", module=TinyModule(seed=5, scheduler=True))
    assert t2.global_step == 14
    a, b = state_of(straight), state_of(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_checkpoint_content_loads_with_weights_only_into_plain_module(tmp_path):
    module, _ = run(tmp_path, 1)
    ckpt = torch.load(tmp_path / "logs" / "version_0" / "checkpoints" / "last.ckpt", weights_only=True)
    assert set(ckpt) >= {"state_dict", "optimizer_states", "lr_schedulers", "loop", "rng", "plugins"}
    plain = TinyModule(seed=9)
    plain.load_state_dict(ckpt["state_dict"])
    assert all(torch.equal(v, module.state_dict()[k]) for k, v in plain.state_dict().items())


class Unpicklable:
    def __reduce__(self):
        raise RuntimeError("simulated crash in the middle of writing")


def test_failed_write_leaves_previous_checkpoint_loadable(tmp_path):
    path = tmp_path / "last.ckpt"
    hookloop.atomic_save({"w": torch.arange(3)}, path)
    big = {"w": torch.randn(1000, 1000), "z": Unpicklable()}
    with pytest.raises(RuntimeError, match="simulated crash"):
        hookloop.atomic_save(big, path)
    assert torch.equal(hookloop.safe_load(path)["w"], torch.arange(3))
    assert os.listdir(tmp_path) == ["last.ckpt"]  # no temporary file left behind


def test_missing_checkpoint(tmp_path):
    with pytest.raises(hookloop.CheckpointError, match="does not exist"):
        run(tmp_path, 1, ckpt_path=tmp_path / "nope.ckpt")
    # "last" before any run wrote one starts from scratch with a warning, as in Lightning.
    with pytest.warns(UserWarning, match=r"ckpt_path='last' but no run under .*empty.* wrote a last.ckpt yet: "
                                         r"starting from scratch"):
        module, trainer = run(tmp_path / "empty", 1, ckpt_path="last")
    fresh, _ = run(tmp_path / "fresh", 1)
    assert trainer.global_step == 7  # one whole epoch of 100 / 16 batches
    assert all(torch.equal(a, b) for a, b in zip(state_of(module).values(), state_of(fresh).values()))


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupt_checkpoint(tmp_path, damage):
    run(tmp_path, 1)
    path = tmp_path / "logs" / "version_0" / "checkpoints" / "last.ckpt"
    data = path.read_bytes()
    path.write_bytes(b"not a checkpoint at all" if damage == "garbage" else data[: len(data) // 2])
    with pytest.raises(hookloop.CheckpointError, match="corrupt"):
        run(tmp_path, 2, ckpt_path=path)


def test_checkpoint_of_a_different_model(tmp_path):
    run(tmp_path, 1)

    class Wider(TinyModule):
        def __init__(self):
            super().__init__()
            self.net[0] = torch.nn.Linear(8, 32)
            self.net[2] = torch.nn.Linear(32, 3)
            self.extra = torch.nn.Linear(1, 1)

    with pytest.raises(hookloop.CheckpointError, match="different model.*unexpected|different model.*missing"):
        run(tmp_path, 2, ckpt_path="last", module=Wider())


def test_pickled_objects_are_refused(tmp_path):
    path = tmp_path / "evil.ckpt"
    import pickle

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    with open(path, "wb") as f:
        pickle.dump({"state_dict": Evil()}, f)
    with pytest.raises(hookloop.CheckpointError):
        hookloop.safe_load(path)
