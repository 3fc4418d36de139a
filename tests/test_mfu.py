"""MFU in the throughput monitor (issue 22 item 3): FLOPs of a training batch against the
closed form of a stack of Linear layers, MFU against FLOPs / step time / the given peak,
and the peak table's lookup by device name."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import hookloop
from hookloop_monitor.throughput import (PEAK_FLOPS, Throughput, chip_of, compute_dtype, flops_totals,
                                         peak_flops_of)

B, WIDTHS = 8, (16, 32, 24, 4)


class LinearStack(hookloop.Module):
    """Linear 16 -> 32 -> ReLU -> 24 -> ReLU -> 4, logging every step."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        layers = []
        for i, (n_in, n_out) in enumerate(zip(WIDTHS, WIDTHS[1:])):
            layers += [nn.Linear(n_in, n_out)] + ([nn.ReLU()] if i < len(WIDTHS) - 2 else [])
        self.net = nn.Sequential(*layers)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def closed_form_flops(batch: int) -> int:
    """Forward: 2*B*in*out per layer; backward: the weight's gradient (2*B*in*out) and the
    input's (2*B*in*out) except for the first layer, whose input needs no gradient."""
    total = 0
    for i, (n_in, n_out) in enumerate(zip(WIDTHS, WIDTHS[1:])):
        total += 2 * batch * n_in * n_out * (2 if i == 0 else 3)
    return total


def loader(n: int = 80) -> DataLoader:
    g = torch.Generator().manual_seed(3)
    return DataLoader(TensorDataset(torch.randn(n, WIDTHS[0], generator=g), torch.randint(0, 4, (n,), generator=g)),
                      batch_size=B)


class Rows:
    hookloop_name = "rows"
    hookloop_role = "observer"

    def __init__(self):
        self.rows = []

    @hookloop.hookimpl
    def on_log_metrics(self, metrics):
        self.rows.append(dict(metrics))


def fit(tmp_path, **options):
    monitor, rows = Throughput(every_n_steps=5, **options), Rows()
    trainer = hookloop.Trainer(max_epochs=1, plugins=[monitor, rows], enable_progress_bar=False,
                               enable_checkpointing=False, default_root_dir=str(tmp_path))
    trainer.fit(LinearStack(), loader())
    return monitor, [r for r in rows.rows if "throughput/batches_per_sec" in r]


def test_flops_of_a_batch_are_the_closed_form_and_mfu_uses_the_given_peak(tmp_path):
    peak = 1e9  # FLOP/s of an imaginary device
    monitor, rows = fit(tmp_path, peak_flops=peak)
    expected = closed_form_flops(B)
    assert expected == 2 * B * (16 * 32 * 2 + 32 * 24 * 3 + 24 * 4 * 3)  # 43008
    assert monitor.flops_per_step == expected
    assert len(rows) == 2  # steps 5 and 10
    for row in rows:
        assert row["throughput/flops_per_step"] == expected
        # batches/s is batches over the window's time: FLOPs/s = FLOPs per batch / step time
        assert row["throughput/flops_per_sec"] == pytest.approx(expected * row["rank0/batches_per_sec"], rel=1e-12)
        assert row["throughput/tflops_per_sec"] == pytest.approx(row["throughput/flops_per_sec"] / 1e12, rel=1e-12)
        assert row["throughput/mfu"] == pytest.approx(expected * row["rank0/batches_per_sec"] / peak, rel=1e-12)


def test_on_the_cpu_mfu_needs_the_peak_and_flops_can_be_off(tmp_path):
    _, rows = fit(tmp_path / "a")
    assert rows and all("throughput/mfu" not in r and r["throughput/flops_per_step"] == closed_form_flops(B)
                        for r in rows)
    monitor, rows = fit(tmp_path / "b", measure_flops=False)
    assert monitor.flops_per_step is None
    assert rows and not any("flops" in k or "mfu" in k for r in rows for k in r)


def test_flops_totals_over_ranks():
    stats = [{"batches_per_sec": 10.0}, {"batches_per_sec": 5.0}]
    row = flops_totals(stats, [100, 200], [1000.0, 1000.0])
    assert row == {"throughput/flops_per_step": 300.0, "throughput/flops_per_sec": 2000.0,
                   "throughput/tflops_per_sec": 2000.0 / 1e12, "throughput/mfu": 1.0}
    assert "throughput/mfu" not in flops_totals(stats, [100, 200], [1000.0, None])
    assert flops_totals(stats, [None, None], [None, None]) == {}


@pytest.mark.parametrize("name, dtype, chip, peak", [
    ("NVIDIA H100 80GB HBM3", "bfloat16", "h100 sxm", 989.4e12),
    ("NVIDIA H100 PCIe", "float16", "h100 pcie", 756e12),
    ("NVIDIA H100 NVL", "tf32", "h100 nvl", 417.5e12),
    ("NVIDIA H200", "bfloat16", "h200 sxm", 989.4e12),
    ("NVIDIA H200 NVL", "bfloat16", "h200 nvl", 835.5e12),
    ("NVIDIA A100-SXM4-80GB", "tf32", "a100", 156e12),
    ("NVIDIA A100-SXM4-40GB", "float32", "a100", 19.5e12),
    ("NVIDIA A10G", "bfloat16", "a10", 125e12),
    ("NVIDIA L4", "float16", "l4", 121e12),
    ("NVIDIA L40S", "bfloat16", "l40s", 362e12),
    ("NVIDIA L40", "bfloat16", "l40", 181e12),
    ("Tesla V100-SXM2-16GB", "float16", "v100 sxm", 125e12),
    ("Tesla T4", "tf32", "t4", 8.1e12),  # no TF32 on a T4: its float32 figure
])
def test_peak_table_lookup_by_device_name(name, dtype, chip, peak):
    assert chip_of(name) == chip
    assert peak_flops_of(name, dtype) == peak
    assert peak == PEAK_FLOPS[chip].get(dtype, PEAK_FLOPS[chip]["float32"])


def test_unknown_devices_and_dtypes():
    assert chip_of("AMD Instinct MI300X") is None and peak_flops_of("AMD Instinct MI300X", "bfloat16") is None
    assert peak_flops_of("Tesla T4", "bfloat16") is None  # a T4 has no bf16
    assert [compute_dtype(p, False) for p in ("32", "32-true", "bf16-mixed", "bf16-true", "16-mixed", "64")] == [
        "float32", "float32", "bfloat16", "bfloat16", "float16", "float64"]
    assert compute_dtype("32", True) == "tf32"


@pytest.mark.parametrize("options", [{"peak_flops": 0}, {"peak_flops": "1e12"}, {"measure_flops": 1}])
def test_bad_options_are_configuration_errors(options):
    with pytest.raises(hookloop.ConfigurationError, match="throughput"):
        Throughput(**options)
