"""Horovod CPU/Gloo smoke check. Run under horovodrun (see BUILD.md):

    PATH=/path/to/venv/bin:$PATH horovodrun -np 2 -H localhost:2 --gloo \
        python plugins/horovod/tests_smoke_horovod.py
"""
import horovod.torch as hvd
import torch

hvd.init()
rank, size = hvd.rank(), hvd.size()
assert hvd.gloo_built() and hvd.gloo_enabled(), "not running on Gloo"

# allreduce: mean of [rank] over ranks == (size - 1) / 2
avg = hvd.allreduce(torch.tensor([float(rank)]), name="rank_avg")
assert torch.allclose(avg, torch.tensor([(size - 1) / 2.0])), avg

torch.manual_seed(rank)  # deliberately different init per rank
model = torch.nn.Linear(4, 1)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
hvd.broadcast_optimizer_state(opt, root_rank=0)
opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())

x, y = torch.randn(8, 4), torch.randn(8, 1)  # different data per rank
for _ in range(3):
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()

# Averaged gradients => identical weights on every rank after the steps.
w = torch.cat([p.detach().flatten() for p in model.parameters()])
w0 = hvd.broadcast(w, root_rank=0, name="w0")
assert torch.allclose(w, w0), "ranks diverged"
print(f"rank {rank}/{size}: allreduce={avg.item():.2f} loss={loss.item():.4f} OK", flush=True)
