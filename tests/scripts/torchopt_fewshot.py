"""A few-shot MAML program written for ``torchopt.distributed``, on small synthetic tasks.

It follows torchopt's ``examples/distributed/few-shot/maml_omniglot.py``: the meta-model travels
as ``todist.rpc.RRef(...)``, each task adapts with ``torchopt.MetaSGD`` on a worker, and the
meta-gradient comes back through ``todist.autograd``. tests/test_interop.py runs it as written
(with TorchOpt) and with the import below changed to ``import metadist as todist``, nothing else.
"""

import torch
import torch.nn.functional as F  # noqa: N812 - as in torchopt's example
import torchopt
import torchopt.distributed as todist
from torch import nn

N_WAY, K_SHOT, N_QUERY, TASKS, FEATURES = 3, 2, 4, 4, 8


def worker_init():
    world_info = todist.get_world_info()
    torch.manual_seed(1 + world_info.rank)
    torch.set_num_threads(1)


def make_batch(generator):
    """``TASKS`` tasks: support and query sets of ``N_WAY`` Gaussian classes."""
    centers = torch.randn(TASKS, N_WAY, FEATURES, generator=generator)

    def sample(per_class):
        y = torch.arange(N_WAY).repeat_interleave(per_class).expand(TASKS, -1)
        noise = 0.5 * torch.randn(TASKS, N_WAY * per_class, FEATURES, generator=generator)
        x = torch.gather(centers, 1, y.unsqueeze(-1).expand(-1, -1, FEATURES)) + noise
        return x, y.contiguous()

    x_spt, y_spt = sample(K_SHOT)
    x_qry, y_qry = sample(N_QUERY)
    return x_spt, y_spt, x_qry, y_qry


def transpose_mean_reducer(results):
    qry_losses, qry_accs = tuple(zip(*results, strict=True))
    return torch.mean(torch.stack(qry_losses)), sum(qry_accs) / len(qry_accs)


@todist.parallelize(
    partitioner=todist.TensorDimensionPartitioner(0, exclusive=True, keepdim=False),
    reducer=transpose_mean_reducer,
)
def inner_loop(net_rref, x_spt, y_spt, x_qry, y_qry, n_inner_iter):
    # Tasks on one worker share the fetched module: each adapts its own differentiable clone.
    net = torchopt.module_clone(net_rref.to_here(), by="clone")
    inner_opt = torchopt.MetaSGD(net, lr=0.3)
    for _ in range(n_inner_iter):
        inner_opt.step(F.cross_entropy(net(x_spt), y_spt))
    qry_logits = net(x_qry)
    qry_loss = F.cross_entropy(qry_logits, y_qry)
    qry_acc = (qry_logits.argmax(dim=1) == y_qry).float().mean().item()
    return qry_loss, qry_acc


@todist.rank_zero_only
def train():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, N_WAY))
    meta_opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(0)
    for step in range(3):
        x_spt, y_spt, x_qry, y_qry = make_batch(generator)
        meta_opt.zero_grad()
        with todist.autograd.context() as context_id:
            net_rref = todist.rpc.RRef(torchopt.module_clone(net, by="copy"))
            qry_loss, qry_acc = inner_loop(net_rref, x_spt, y_spt, x_qry, y_qry, 2)
            todist.autograd.backward(context_id, qry_loss)
        grad_norm = torch.cat([p.grad.flatten() for p in net.parameters()]).norm().item()
        meta_opt.step()
        print(f"STEP {step} loss={qry_loss.item():.9f} acc={qry_acc:.6f} grad={grad_norm:.9f}")
    print(f"FINAL {sum(p.detach().double().sum().item() for p in net.parameters()):.9f}")


@todist.auto_init_rpc(worker_init)
def main():
    assert todist.is_available()
    assert todist.on_rank(todist.get_world_size())(lambda: "never")() is None
    train()


if __name__ == "__main__":
    main()
