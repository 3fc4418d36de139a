"""hookloop-fairscale's pipe strategy and activation_checkpointing extension, in this
process (pipe drives several devices from one process: ["cpu", "cpu"] here runs fairscale's
partitioning, micro-batching and checkpointing for real).

References: the same ``nn.Sequential`` unpartitioned, a plain run without the plugin, a
split worked out by hand, saved-tensor bytes counted with autograd's own hooks.
"""

from __future__ import annotations

import copy
import gc
import itertools
import re
import sys

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader

import hookloop
from conftest import REPO, max_abs_diff, run_python, state_of, tiny_data
from hookloop_fairscale import balance_by_parameters
from hookloop_fairscale.balance import choose_balance
from hookloop_fairscale.pipe import build_pipe, release_pipe

CPU2 = ["cpu", "cpu"]


def layers(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))


class SeqNet(hookloop.Module):
    """A module whose layers are in ``sequential_module`` (Lightning's sequential plugin)."""

    def __init__(self, seed: int = 0):
        super().__init__()
        self.sequential_module = layers(seed)

    def forward(self, x):
        return self.sequential_module(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_acc", (self(x).argmax(-1) == y).float().mean())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class Losses:
    hookloop_name, hookloop_role = "losses", "observer"

    def __init__(self):
        self.losses: list[float] = []

    @hookloop.hookimpl
    def on_train_batch_end(self, loss):
        self.losses.append(float(loss))


def fit(plugins=(), precision="32", module=None, epochs=2):
    losses = Losses()
    trainer = hookloop.Trainer(plugins=[*plugins, losses], max_epochs=epochs, precision=precision,
                               enable_checkpointing=False, num_sanity_val_steps=1)
    module = module or SeqNet()
    trainer.fit(module, DataLoader(tiny_data(48), batch_size=12), DataLoader(tiny_data(24, seed=2), batch_size=12))
    return trainer, module, losses.losses


@pytest.mark.parametrize("balance, chunks, checkpoint, devices", [
    ([2, 3], 1, "never", CPU2),
    ([1, 4], 4, "always", CPU2),
    ([3, 2], 3, "except_last", CPU2),
    ([1, 1, 3], 2, "except_last", ["cpu"] * 3),
])
def test_pipe_output_and_gradients_equal_the_unpartitioned_sequential(balance, chunks, checkpoint, devices):
    reference, split = layers(), layers()
    x = torch.randn(12, 8, generator=torch.Generator().manual_seed(3))
    expected = reference(x)
    (expected ** 2).sum().backward()
    pipe = build_pipe(split, balance, [torch.device(d) for d in devices], chunks, checkpoint)
    try:
        assert [len(p) for p in pipe.partitions] == balance
        output = pipe(x)
        (output ** 2).sum().backward()
    finally:
        release_pipe(pipe)
        del pipe
        gc.collect()
    assert (output - expected).abs().max() <= 1e-6
    for (name, a), b in zip(split.named_parameters(), reference.parameters()):
        assert (a.grad - b.grad).abs().max() <= 1e-6, name


def test_pipe_strategy_trains_like_the_plain_module_and_leaves_it_as_it_was(tmp_path):
    plain_trainer, plain, plain_losses = fit()
    pipe = hookloop.plugin("pipe", balance=[2, 3], chunks=4, devices=CPU2)
    trainer, module, losses = fit([pipe])
    assert losses == pytest.approx(plain_losses, abs=1e-6)
    assert max_abs_diff(state_of(module), state_of(plain)) <= 1e-6
    assert trainer.callback_metrics["val_acc"] == pytest.approx(plain_trainer.callback_metrics["val_acc"])
    # After the run: the module's own Sequential again, state-dict keys the user's.
    assert "forward" not in vars(module.sequential_module) and pipe.pipe is None
    trainer.save_checkpoint(tmp_path / "pipe.ckpt")
    saved = torch.load(tmp_path / "pipe.ckpt", weights_only=True)["state_dict"]
    assert sorted(saved) == sorted(SeqNet().state_dict())


def test_pipe_runs_its_partitions_under_the_callers_autocast():
    _, fp32, _ = fit()
    _, bf16, _ = fit(precision="bf16-mixed")
    _, piped, _ = fit([hookloop.plugin("pipe", balance=[2, 3], chunks=2, devices=CPU2)], precision="bf16-mixed")
    # Without autocast in fairscale's worker threads the pipe would train in fp32.
    assert max_abs_diff(state_of(piped), state_of(bf16)) < 1e-3 < max_abs_diff(state_of(piped), state_of(fp32))


@pytest.mark.slow
def test_pipe_trains_the_digits_example_past_90_percent(tmp_path):
    script = REPO / "plugins" / "fairscale" / "examples" / "pipe_digits.py"
    proc = run_python([sys.executable, "-m", "hookloop", "run", "--plugins", "pipe",
                       "--plugin-option", 'pipe.devices=["cpu", "cpu"]', "--plugin-option", "pipe.balance=[3, 2]",
                       "--plugin-option", "pipe.chunks=4", "--max-epochs", "5", "--default-root-dir", str(tmp_path),
                       str(script)], cwd=tmp_path, timeout=300)
    accuracy = float(re.search(r"validation accuracy: ([0-9.]+)", proc.stdout).group(1))
    assert accuracy >= 0.9


# -- balance -------------------------------------------------------------------------------------


def best_split_by_hand(costs: list[int], stages: int) -> list[int]:
    """Every contiguous split, the smallest largest stage, the earliest such."""
    best = None
    for cuts in itertools.combinations(range(1, len(costs)), stages - 1):
        bounds = (0, *cuts, len(costs))
        sizes = [bounds[i + 1] - bounds[i] for i in range(stages)]
        worst = max(sum(costs[bounds[i]:bounds[i + 1]]) for i in range(stages))
        if best is None or worst < best[0]:
            best = (worst, sizes)
    return best[1]


@pytest.mark.parametrize("stages", [2, 3])
def test_balance_by_parameter_count_is_the_best_contiguous_split(stages):
    sequential = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    costs = [sum(p.numel() for p in layer.parameters()) for layer in sequential]  # 4160, 0, 4160, 0, 650
    assert balance_by_parameters(sequential, stages) == best_split_by_hand(costs, stages)


def test_balance_is_chosen_and_printed_when_not_given(capsys):
    fit([hookloop.plugin("pipe", devices=CPU2)], epochs=1)
    out = capsys.readouterr().out
    assert "hookloop-fairscale: pipe balance [1, 4] over ['cpu', 'cpu'], chosen no example_input_array" in out
    assert "by parameter count (parameters per stage: 144, 323)" in out
    module = SeqNet()
    module.example_input_array = torch.randn(16, 8)
    balance, how = choose_balance("pipe", module, module.sequential_module, 2, torch.device("cpu"))
    assert sum(balance) == 5 and len(balance) == 2 and how.startswith("by time (fairscale's balance_by_time")


# -- activation checkpointing ---------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, width: int = 64):
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(width, 4 * width), nn.Tanh(), nn.Linear(4 * width, width), nn.Tanh())

    def forward(self, x):
        return x + self.inner(x)


class Blocks(hookloop.Module):
    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.blocks = nn.Sequential(*[Block() for _ in range(3)], nn.Linear(64, 3))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.blocks(x.repeat(1, 8)), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def saved_bytes_and_gradients(model: nn.Module, x: torch.Tensor):
    """Bytes autograd keeps for the backward pass during the forward (each storage once),
    and the gradients."""
    storages: dict[int, int] = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x).pow(2).mean()
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    activations = sum(n for ptr, n in storages.items() if ptr not in parameters)
    loss.backward()
    return activations, {name: p.grad.clone() for name, p in model.named_parameters()}


def test_activation_checkpointing_keeps_fewer_activations_and_gives_the_same_gradients():
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(0))
    plain, checkpointed = Blocks().blocks, copy.deepcopy(Blocks().blocks)
    wrapped = hookloop.plugin("activation_checkpointing", modules=["Block", "Linear"]).apply(checkpointed)
    assert wrapped == ["0", "1", "2", "3"]  # the Linears inside the blocks are not wrapped twice
    plain_bytes, plain_grads = saved_bytes_and_gradients(plain, x)
    kept_bytes, grads = saved_bytes_and_gradients(checkpointed, x)
    for name, grad in plain_grads.items():
        assert (grads[name] - grad).abs().max() <= 1e-6, name
    # Each block keeps its input (32 x 64 floats) instead of its 4 inner activations.
    assert kept_bytes <= plain_bytes / 3, (kept_bytes, plain_bytes)


def test_activation_checkpointing_recomputes_under_the_forwards_cpu_autocast():
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(0))
    plain, checkpointed = Blocks().blocks, copy.deepcopy(Blocks().blocks)
    hookloop.plugin("activation_checkpointing", modules=["Linear"]).apply(nn.Sequential(checkpointed))
    for model in (plain, checkpointed):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            output = model(x)
        output.float().pow(2).mean().backward()  # fairscale alone recomputes in fp32 here, and fails
    for a, b in zip(plain.parameters(), checkpointed.parameters()):
        assert torch.equal(a.grad, b.grad)


def test_activation_checkpointing_plugin_trains_like_without_and_unwraps():
    results = []
    for plugins in ([], [hookloop.plugin("activation_checkpointing", modules=[Block])]):
        module = Blocks()
        hookloop.Trainer(plugins=plugins, max_epochs=1, enable_checkpointing=False).fit(
            module, DataLoader(tiny_data(32), batch_size=8))
        results.append(module)
    assert max_abs_diff(state_of(results[0]), state_of(results[1])) <= 1e-6
    assert not any("forward" in vars(m) for m in results[1].modules())


# -- bad input -------------------------------------------------------------------------------------


class NoSequential(SeqNet):
    def __init__(self):
        super().__init__()
        del self.sequential_module
        self.net = layers()

    def forward(self, x):
        return self.net(x)


class NotSequential(SeqNet):
    def __init__(self):
        super().__init__()
        self.sequential_module = nn.ModuleList(layers())


@pytest.mark.parametrize("module, options, message", [
    (NoSequential, {"balance": [2, 3]}, "NoSequential has no sequential_module: put the layers to pipeline in an nn.Sequential"),
    (NotSequential, {"balance": [2, 3]}, "which needs an nn.Sequential, and it is a ModuleList"),
    (SeqNet, {"balance": [2, 2]}, r"balance=\[2, 2\] places 4 layers, but sequential_module has 5.*e.g. \[3, 2\]"),
    (SeqNet, {"balance": [2, 3], "devices": ["cpu"]}, "2 partitions and devices=.* 1: give one device per partition"),
])
def test_pipe_refuses_what_it_cannot_split(module, options, message):
    trainer = hookloop.Trainer(plugins=[hookloop.plugin("pipe", **options)], max_epochs=1, enable_checkpointing=False)
    with pytest.raises(hookloop.ConfigurationError, match=message):
        trainer.fit(module(), DataLoader(tiny_data(16), batch_size=8))


@pytest.mark.parametrize("options, message", [
    ({"balance": [2, 0]}, "balance=.*positive layer counts"),
    ({"chunks": 0}, "chunks=0 must be an integer >= 1"),
    ({"checkpoint": "sometimes"}, "checkpoint='sometimes' must be one of"),
])
def test_pipe_options_are_checked_when_set(options, message):
    with pytest.raises(hookloop.ConfigurationError, match=message):
        hookloop.Trainer(plugins=["pipe"], plugin_options={"pipe": options})


def test_activation_checkpointing_names_what_it_could_not_find():
    with pytest.raises(hookloop.ConfigurationError, match=r"matches no submodule of Blocks.*did you mean 'Block'"):
        hookloop.plugin("activation_checkpointing", modules=["Blok"]).apply(Blocks())
    with pytest.raises(hookloop.ConfigurationError, match="has no modules to checkpoint"):
        hookloop.plugin("activation_checkpointing").apply(Blocks())
