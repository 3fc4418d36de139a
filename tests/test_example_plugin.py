"""The third-party example package (examples/hookloop-ema) pip-installs and runs by name."""

import subprocess
import sys
import textwrap

import pytest
from conftest import REPO, run_python

SCRIPT = textwrap.dedent(
    """
    import sys, torch
    from torch.utils.data import DataLoader
    sys.path.insert(0, {tests!r})
    import hookloop
    from conftest import TinyModule, tiny_data
    from torch.nn import functional as F

    assert "example_ema" in hookloop.installed_plugins()
    data = tiny_data(64)

    # Reference: a hand-written loop keeping the EMA after every optimizer step.
    ref = TinyModule()
    opt = ref.configure_optimizers()
    ema = {{k: v.clone() for k, v in ref.state_dict().items()}}
    torch.manual_seed(0)
    for epoch in range(2):
        for x, y in DataLoader(data, batch_size=8, shuffle=True):
            F.cross_entropy(ref(x), y).backward()
            opt.step(); opt.zero_grad(set_to_none=True)
            for k, v in ref.state_dict().items():
                ema[k].mul_(0.8).add_(v, alpha=0.2)

    module = TinyModule()
    torch.manual_seed(0)
    trainer = hookloop.Trainer(plugins=[hookloop.plugin("example_ema", decay=0.8)], max_epochs=2, default_root_dir="run")
    trainer.fit(module, DataLoader(data, batch_size=8, shuffle=True))
    for k, v in module.state_dict().items():
        assert torch.allclose(v, ema[k], atol=1e-7), k
    # Its state went into the checkpoint, loadable with weights_only=True.
    ckpt = torch.load("run/logs/version_0/checkpoints/last.ckpt", weights_only=True)
    assert set(ckpt["plugins"]["example_ema"]["shadow"]) == set(ema)

    # And by plain name, as `--plugins example_ema` / HOOKLOOP_PLUGINS would do.
    named = hookloop.Trainer(plugins=["example_ema"], max_epochs=1, enable_checkpointing=False,
                             enable_progress_bar=False, logger=False)
    assert [type(p).__name__ for p in named.plugins] == ["EMA", "ModelSummary"]
    print("EMA-OK")
    """
)


@pytest.mark.slow
def test_pip_install_and_enable_by_name(tmp_path):
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
         "--disable-pip-version-check", "--target", str(target), str(REPO / "examples" / "hookloop-ema")],
        check=True, capture_output=True, timeout=300,
    )
    assert list(target.glob("hookloop_ema-*.dist-info/entry_points.txt"))
    (tmp_path / "check.py").write_text(SCRIPT.format(tests=str(REPO / "tests")))
    out = run_python([sys.executable, "check.py"], cwd=tmp_path, env={"PYTHONPATH": str(target)})
    assert "EMA-OK" in out.stdout
    # The worked example passes the contract check it teaches.
    checked = run_python([sys.executable, "-m", "hookloop", "check", "example_ema"], cwd=tmp_path, env={"PYTHONPATH": str(target)})
    assert checked.stdout.strip() == "example_ema: ok"
