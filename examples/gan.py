"""A GAN on scikit-learn's bundled digits: two optimizers, stepped by hand.

    hookloop run examples/gan.py                                  # one process
    hookloop run --plugins ddp --devices 2 examples/gan.py        # two processes

Manual optimization as in Lightning 2 (``self.automatic_optimization = False``): the
module steps its generator's and discriminator's optimizers itself, and hookloop routes
``manual_backward`` and each ``step()`` through the strategy and precision plugins (DDP
synchronises the gradients, AMP scales them). Under ddp, ``find_unused_parameters`` is
needed: each backward reaches only one of the two networks.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import hookloop

LATENT = 16


def digits() -> TensorDataset:
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    return TensorDataset(torch.tensor(x, dtype=torch.float32) / 16.0, torch.tensor(y))


class GAN(hookloop.Module):
    def __init__(self, lr: float = 2e-3):
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.generator = nn.Sequential(nn.Linear(LATENT, 64), nn.ReLU(), nn.Linear(64, 64), nn.Sigmoid())
        self.discriminator = nn.Sequential(nn.Linear(64, 64), nn.LeakyReLU(0.2), nn.Linear(64, 1))

    def forward(self, z):
        return self.generator(z)

    def training_step(self, batch, batch_idx):
        real, _ = batch
        opt_g, opt_d = self.optimizers()
        z = torch.randn(real.shape[0], LATENT, device=self.device)
        fake = self(z)

        # Discriminator: real -> 1, fake -> 0 (the generator is frozen meanwhile).
        self.toggle_optimizer(opt_d)
        d_loss = F.softplus(-self.discriminator(real)).mean() + F.softplus(self.discriminator(fake.detach())).mean()
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()
        self.untoggle_optimizer(opt_d)

        # Generator: make the discriminator say 1 for fakes.
        self.toggle_optimizer(opt_g)
        g_loss = F.softplus(-self.discriminator(fake)).mean()
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        self.clip_gradients(opt_g, gradient_clip_val=1.0)
        opt_g.step()
        self.untoggle_optimizer(opt_g)

        self.log_dict({"d_loss": d_loss, "g_loss": g_loss}, prog_bar=True)

    def on_train_epoch_end(self):
        # How far the generated pixels' mean is from the data's: it shrinks as G learns.
        with torch.no_grad():
            fake = self(torch.randn(512, LATENT, device=self.device))
        self.log("pixel_mean_gap", (fake.mean() - self.data_mean).abs(), sync_dist=True)

    def configure_optimizers(self):
        lr = self.hparams.lr
        opt_g = torch.optim.Adam(self.generator.parameters(), lr=lr, betas=(0.5, 0.999))
        opt_d = torch.optim.Adam(self.discriminator.parameters(), lr=lr, betas=(0.5, 0.999))
        return [opt_g, opt_d]


def main(max_epochs: int = 15) -> dict:
    hookloop.seed_everything(0)
    data = digits()
    module = GAN()
    module.data_mean = data.tensors[0].mean().item()
    trainer = hookloop.Trainer(
        max_epochs=hookloop.default(max_epochs),
        # Only used when the run is a ddp run (hookloop run --plugins ddp ...).
        plugin_options={"ddp": {"find_unused_parameters": True}},
    )
    trainer.fit(module, DataLoader(data, batch_size=64, shuffle=True, drop_last=True))
    metrics = trainer.callback_metrics
    trainer.print(
        f"d_loss {metrics['d_loss']:.3f}  g_loss {metrics['g_loss']:.3f}  "
        f"pixel mean gap {metrics['pixel_mean_gap']:.4f}  ({trainer.global_step} optimizer steps)"
    )
    return metrics


if __name__ == "__main__":
    main()
