"""MAML outer-step benchmark: a per-task loop, vmap, metadist and torchopt.distributed.

Workload (issue 5): the 4-block conv net, 5-way 1-shot glyph episodes with 15 query images per
class, 8 tasks per meta-batch, 1 inner SGD step, second-order meta-gradient. One outer step
is forward, backward and the Adam meta-step; the median over ``--repeats`` steps (after
``--warmup``) is reported for

* (a)  one process looping over the tasks, 1 thread; (a2) the same with all cores;
* (b)  one process, ``torch.func.vmap`` over the tasks, 1 thread; (b2) all cores;
* (c)  metadist, ``@parallelize`` over the task dimension, W workers under torchrun
       (W = 2, plus 4 and 8 where the machine has that many cores), ``loss.backward()``;
* (k)  the same on 2 workers in the torchopt form: ``metadist.autograd.context()`` and
       ``metadist.autograd.backward`` (ran in the same run as (c), for the ratio of the forms);
* (l)  the limit: 2 processes under torchrun, each its half of the tasks and its own Adam
       step on its half's gradient, no communication but a barrier ending each step; the best
       any 2-worker variant can do on this machine (the efficiency ceiling);
* (d)  ``torchopt.distributed`` 0.7.3 on 2 workers, written the way its docs and distributed
       MAML example do it: ``RRef(module_clone(net, by='copy'))`` and one task per call. It is
       imported from ``.bench-deps/torchopt`` (never installed into the project environment)::

           pip install --target .bench-deps/torchopt torchopt==0.7.3 optree graphviz --no-deps

The (c) run also checks that metadist's meta-gradient equals (a)'s (relative error <= 1e-5).

Run: ``python benchmarks/bench_maml.py`` (``--repeats 3 --warmup 1`` for a quick smoke test;
``--out FILE`` saves the rounds for ``bench_overhead.py --summary``;
``--rounds N`` runs every variant N times in turn, and each ratio is the median of its
per-round ratios).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples" / "maml"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from data import FewShotBatch, GlyphDataset, sample_fewshot  # noqa: E402
from maml import meta_objective  # noqa: E402
from models import ConvNet  # noqa: E402
from torch import Tensor, nn  # noqa: E402
from training import configure_threads  # noqa: E402

__all__ = ["main"]

N_WAY, K_SHOT, K_QUERY, TASKS, INNER_LR, INNER_STEPS, SEED = 5, 1, 15, 8, 0.4, 1, 0
TORCHOPT_DIR = ROOT / ".bench-deps" / "torchopt"


def workload() -> tuple[nn.Module, FewShotBatch]:
    """The same seeded conv net and task batch in every process."""
    torch.manual_seed(SEED)
    net = ConvNet(n_way=N_WAY)
    batch = sample_fewshot(
        GlyphDataset(seed=SEED),
        "train",
        np.random.default_rng(SEED),
        TASKS,
        n_way=N_WAY,
        k_shot=K_SHOT,
        k_query=K_QUERY,
    )
    return net, batch


def workload_tensors() -> tuple[nn.Module, tuple[Tensor, ...]]:
    """:func:`workload`, its batch as the four tensors the loss takes."""
    net, b = workload()
    return net, (b.x_spt, b.y_spt, b.x_qry, b.y_qry)


def flat_grad(net: nn.Module) -> Tensor:
    """All parameter gradients as one vector."""
    return torch.cat([p.grad.reshape(-1) for p in net.parameters() if p.grad is not None])


def reference_meta_grad(net: nn.Module, b: FewShotBatch) -> Tensor:
    """(a)'s meta-gradient at the current parameters (left in ``.grad``), as one vector."""
    meta_objective(
        net,
        b.x_spt,
        b.y_spt,
        b.x_qry,
        b.y_qry,
        F.cross_entropy,
        steps=INNER_STEPS,
        lr=INNER_LR,
        vectorize=False,
    )[0].backward()
    return flat_grad(net).clone()


def time_steps(step: Callable[[], None], repeats: int, warmup: int) -> list[float]:
    """Wall time of ``repeats`` calls of ``step`` after ``warmup`` untimed ones."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return times


def local_step(
    net: nn.Module, opt: torch.optim.Optimizer, b: FewShotBatch, vectorize: bool
) -> None:
    """One outer step in this process: (a) with ``vectorize=False``, (b) with True."""
    opt.zero_grad()
    loss, _ = meta_objective(
        net,
        b.x_spt,
        b.y_spt,
        b.x_qry,
        b.y_qry,
        F.cross_entropy,
        steps=INNER_STEPS,
        lr=INNER_LR,
        classify=True,
        vectorize=vectorize,
    )
    loss.backward()
    opt.step()


def run_local(variant: str, threads: int, args: argparse.Namespace) -> list[float]:
    """Time variant (a)/(b) in this process with ``threads`` intra-op threads."""
    torch.set_num_threads(threads)
    net, b = workload()
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    vectorize = variant.startswith("b")
    return time_steps(lambda: local_step(net, opt, b, vectorize), args.repeats, args.warmup)


# --------------------------------------------------------------------------- (c) metadist


def _metadist_loss(
    model: nn.Module, x_spt: Tensor, y_spt: Tensor, x_qry: Tensor, y_qry: Tensor
) -> Tensor:
    """Mean query loss of this worker's contiguous chunk of tasks (a per-task loop)."""
    loss, _ = meta_objective(
        model,
        x_spt,
        y_spt,
        x_qry,
        y_qry,
        F.cross_entropy,
        steps=INNER_STEPS,
        lr=INNER_LR,
        vectorize=False,
    )
    return loss


def role_metadist(args: argparse.Namespace) -> None:
    """Body of each torchrun worker for (c); rank 0 times and writes ``args.json``."""
    import metadist

    meta_loss = metadist.parallelize(
        partitioner=metadist.dim_partitioner(0), reducer=metadist.mean_reducer
    )(_metadist_loss)

    @metadist.rank_zero_only
    def drive() -> None:
        net, b = workload()
        opt = torch.optim.Adam(net.parameters(), lr=1e-3)
        # Reference meta-gradient of (a), then metadist's, at the same initial parameters.
        reference = reference_meta_grad(net, b)

        context_form = os.environ.get("BENCH_MAML_FORM") == "context"

        def backward() -> None:
            if not context_form:
                meta_loss(net, b.x_spt, b.y_spt, b.x_qry, b.y_qry).backward()
                return
            with metadist.autograd.context() as ctx:
                loss = meta_loss(net, b.x_spt, b.y_spt, b.x_qry, b.y_qry)
                metadist.autograd.backward(ctx, [loss])

        def step() -> None:
            opt.zero_grad()
            backward()
            opt.step()

        opt.zero_grad()
        backward()
        got = flat_grad(net)
        rel = ((got - reference).norm() / reference.norm()).item()
        times = time_steps(step, args.repeats, args.warmup)
        Path(args.json).write_text(json.dumps({"times": times, "grad_rel_err": rel}))

    metadist.auto_init_rpc(configure_threads)(drive)()


# --------------------------------------------------------------------------- (e) SPMD


def role_spmd(args: argparse.Namespace) -> None:
    """(e) the learn2learn pattern: each worker its chunk, a local backward, an all-reduce;
    (l) the limit: the same without the all-reduce (each worker steps on its own half's
    gradient), a barrier ending every step, so that a step takes what the slower half takes."""
    import torch.distributed as dist

    limit = args.role == "limit"
    configure_threads()
    dist.init_process_group("gloo")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        net, b = workload()
        opt = torch.optim.Adam(net.parameters(), lr=1e-3)
        reference = reference_meta_grad(net, b) if rank == 0 and not limit else None
        tensors = (b.x_spt, b.y_spt, b.x_qry, b.y_qry)
        mine = [torch.tensor_split(t, world)[rank] for t in tensors]
        weight = len(mine[0]) / len(tensors[0])  # the global mean, whatever the split

        def step() -> None:
            opt.zero_grad()
            (_metadist_loss(net, *mine) * weight).backward()
            if limit:
                return
            grads = [q.grad for q in net.parameters() if q.grad is not None]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat)
            for g, reduced in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
                g.copy_(reduced.view_as(g))

        step()
        got = flat_grad(net)

        def timed() -> None:
            step()
            opt.step()
            if limit:
                dist.barrier()

        times = time_steps(timed, args.repeats, args.warmup)
        if rank == 0:
            result: dict[str, object] = {"times": times}
            if reference is not None:
                result["grad_rel_err"] = ((got - reference).norm() / reference.norm()).item()
            Path(args.json).write_text(json.dumps(result))
        dist.barrier()
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------- (d) torchopt


def _torchopt_mean_reducer(results: list[Tensor]) -> Tensor:
    return torch.stack(results).mean()


def _torchopt_inner_loop(
    net_rref: object, x_spt: Tensor, y_spt: Tensor, x_qry: Tensor, y_qry: Tensor
) -> Tensor:
    """One task, as in torchopt's examples/distributed/few-shot/maml_omniglot.py."""
    import torchopt

    original_net = net_rref.to_here()  # type: ignore[attr-defined]
    net = torchopt.module_clone(original_net, by="reference", detach_buffers=True)
    inner_opt = torchopt.MetaSGD(net, lr=INNER_LR)
    for _ in range(INNER_STEPS):
        inner_opt.step(F.cross_entropy(net(x_spt), y_spt))
    return F.cross_entropy(net(x_qry), y_qry)


def role_torchopt(args: argparse.Namespace) -> None:
    """Body of each torchrun worker for (d); rank 0 times and writes ``args.json``."""
    import torchopt
    import torchopt.distributed as todist
    from torch.distributed import autograd as dist_autograd

    inner_loop = todist.parallelize(
        partitioner=todist.dim_partitioner(dim=0, exclusive=True, keepdim=False),
        reducer=_torchopt_mean_reducer,
    )(_torchopt_inner_loop)

    @todist.rank_zero_only
    def drive() -> None:
        net, b = workload()
        opt = torch.optim.Adam(net.parameters(), lr=1e-3)
        reference = reference_meta_grad(net, b)

        def step(apply: bool = True) -> None:
            opt.zero_grad()
            # torchopt's documented recipe: parameters sent over RPC arrive detached, so the
            # module is cloned by copy (CloneBackward keeps the graph) and wrapped in an RRef.
            net_rref = todist.rpc.RRef(torchopt.module_clone(net, by="copy"))
            with dist_autograd.context() as ctx:
                loss = inner_loop(net_rref, b.x_spt, b.y_spt, b.x_qry, b.y_qry)
                todist.autograd.backward(ctx, loss)
                if apply:
                    opt.step()

        step(apply=False)
        rel = ((flat_grad(net) - reference).norm() / reference.norm()).item()
        times = time_steps(step, args.repeats, args.warmup)
        Path(args.json).write_text(json.dumps({"times": times, "grad_rel_err": rel}))

    todist.auto_init_rpc(lambda: torch.set_num_threads(1))(drive)()


# --------------------------------------------------------------------------- driver


def run_world(
    role: str, workers: int, args: argparse.Namespace, extra_env: dict[str, str] | None = None
) -> dict[str, object] | None:
    """Run this script under torchrun in ``role``; return rank 0's JSON or None on failure."""
    env = {**os.environ, **(extra_env or {})}
    if role == "torchopt":
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(TORCHOPT_DIR), env.get("PYTHONPATH", "")) if p
        )
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={workers}", __file__, "--role", role, "--json", str(out),
            "--repeats", str(args.repeats), "--warmup", str(args.warmup),
        ]  # fmt: skip
        proc = subprocess.run(
            cmd, env=env, capture_output=True, text=True, timeout=args.timeout, check=False
        )
        if proc.returncode != 0 or not out.exists():
            print(f"  ({role}, W={workers}) failed with exit code {proc.returncode}:")
            print("  " + "\n  ".join((proc.stdout + proc.stderr).strip().splitlines()[-25:]))
            return None
        return json.loads(out.read_text())  # type: ignore[no-any-return]


def fmt(times: list[float]) -> str:
    return f"{statistics.median(times) * 1e3:9.1f} ms  (min {min(times) * 1e3:.1f}, n={len(times)})"


class Variant(NamedTuple):
    """One timed variant: its key in the report, how it runs, and its label."""

    key: str
    role: str  # "local" (in this process) or a torchrun role
    workers: int  # threads for "local", processes otherwise
    env: dict[str, str] | None
    label: str


def _plan(variants: set[str], cores: int) -> list[Variant]:
    """The selected variants, in the order each round runs them."""
    plan = [
        Variant(key, "local", threads, None, f"single process, {label}")
        for key, label, threads in (
            ("a", "loop, 1 thread", 1),
            ("a2", f"loop, {cores} threads", cores),
            ("b", "vmap, 1 thread", 1),
            ("b2", f"vmap, {cores} threads", cores),
        )
        if key in variants
    ]
    if "c" in variants:
        plan += [
            Variant(f"c{w}", "metadist", w, None, f"metadist, {w} workers")
            for w in (2, 4, 8)
            if w == 2 or cores >= w
        ]
    if "k" in variants:
        env = {"BENCH_MAML_FORM": "context"}
        plan.append(Variant("k", "metadist", 2, env, "metadist, 2 workers, context form"))
    if "e" in variants:
        plan.append(Variant("e", "spmd", 2, None, "SPMD all-reduce, 2 workers"))
    if "l" in variants:
        plan.append(Variant("l", "limit", 2, None, "the limit: 2 processes, half each"))
    # (d1): torchopt with the malloc setting metadist applies itself (see the docs'
    # performance page), so that the comparison isolates the rest of the design.
    if "d" in variants:
        plan.append(Variant("d", "torchopt", 2, None, "torchopt.distributed, 2 workers"))
    if "d1" in variants:
        env = {"MALLOC_ARENA_MAX": "1"}
        plan.append(Variant("d1", "torchopt", 2, env, "  same, MALLOC_ARENA_MAX=1"))
    return plan


def main() -> None:
    """Parse options and run the benchmark (or one torchrun role of it)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=15, help="timed outer steps per variant")
    p.add_argument("--warmup", type=int, default=3, help="untimed outer steps first")
    p.add_argument("--variants", default="a,a2,b,b2,c,k,e,d,d1", help="comma-separated subset")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per torchrun world")
    p.add_argument("--rounds", type=int, default=1, help="interleaved rounds of every variant")
    p.add_argument(
        "--role", choices=("metadist", "torchopt", "spmd", "limit"), help=argparse.SUPPRESS
    )
    p.add_argument("--json", help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help="save the rounds' medians here (for the summary)")
    args = p.parse_args()
    if args.role == "metadist":
        role_metadist(args)
        return
    if args.role == "torchopt":
        role_torchopt(args)
        return
    if args.role in ("spmd", "limit"):
        role_spmd(args)
        return

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cores = cores or 1
    variants = set(args.variants.split(","))
    print(
        f"MAML outer step: conv net, {N_WAY}-way {K_SHOT}-shot, {K_QUERY} query/class,"
        f" {TASKS} tasks, {INNER_STEPS} inner step, second order; torch {torch.__version__},"
        f" {cores} cores; median of {args.repeats} after {args.warmup} warm-up"
        + (f", {args.rounds} interleaved rounds" if args.rounds > 1 else "")
    )
    plan = _plan(variants, cores)
    if variants & {"d", "d1"} and not (TORCHOPT_DIR / "torchopt").is_dir():
        print(
            f"(d  ) skipped: torchopt 0.7.3 not found in {TORCHOPT_DIR}; install it with\n"
            "      pip install --target .bench-deps/torchopt torchopt==0.7.3 optree graphviz"
            " --no-deps"
        )
        plan = [v for v in plan if v.role != "torchopt"]
    # Every variant once per round, in turn: the machine's drift then meets them all alike, and
    # each ratio below is the median of its per-round ratios.
    times: dict[str, list[float]] = {v.key: [] for v in plan}
    rounds: dict[str, list[float | None]] = {v.key: [] for v in plan}  # None: it failed
    rel_errs: dict[str, float] = {}
    for _ in range(args.rounds):
        for v in plan:
            if v.role == "local":
                got: list[float] | None = run_local(v.key, v.workers, args)
            else:
                res = run_world(v.role, v.workers, args, v.env)
                got = None if res is None else list(res["times"])  # type: ignore[call-overload]
                if res is not None and "grad_rel_err" in res:
                    rel_errs[v.key] = float(res["grad_rel_err"])  # type: ignore[arg-type]
            times[v.key] += got or []
            rounds[v.key].append(statistics.median(got) if got else None)
    torch.set_num_threads(cores)
    for v in plan:
        if times[v.key]:
            print(f"({v.key[:3]:<3}) {v.label:<38} {fmt(times[v.key])}", flush=True)
    med = {key for key, got in times.items() if got}  # the variants that ran

    def ratio(a: str, b: str) -> float:
        """Median over rounds of time(a) / time(b) (rounds where both ran)."""
        pairs = [x / y for x, y in zip(rounds[a], rounds[b], strict=True) if x and y]
        return statistics.median(pairs) if pairs else float("nan")

    print()
    for key, err in rel_errs.items():
        ok = "ok" if err <= 1e-5 else "FAIL (target <= 1e-5)"
        print(f"meta-gradient of ({key}) vs (a): relative error {err:.2e}  {ok}")
    if "a" in med:
        for key in ("a2", "b", "b2"):
            if key in med:
                print(f"time(a) / time({key}) = {ratio('a', key):.2f}x")
        for w in (2, 4, 8):
            if f"c{w}" in med:
                eff = ratio("a", f"c{w}") / w
                tgt = "  (target >= 0.95)" if w == 2 else ""
                print(
                    f"metadist W={w}: speed-up over (a) {ratio('a', f'c{w}'):.2f}x,"
                    f" parallel efficiency time(a)/({w} x time(c)) = {eff:.2f}{tgt}"
                )
        for key in ("d", "d1"):
            if key in med:
                eff = ratio("a", key) / 2
                print(
                    f"torchopt W=2 ({key}): parallel efficiency time(a)/(2 x time({key}))", end=""
                )
                print(f" = {eff:.2f}")
    if "c2" in med and "k" in med:
        eff = f"{ratio('a', 'k') / 2:.2f}" if "a" in med else "n/a"
        print(
            f"context form (k): time(k) / time(c) = {ratio('k', 'c2'):.3f}  (target <= 1.03),"
            f" parallel efficiency {eff}  (target >= 0.95)"
        )
    if "c2" in med and "e" in med:
        eff = ratio("a", "e") / 2 if "a" in med else float("nan")
        print(
            f"SPMD W=2 (e): parallel efficiency {eff:.2f}; time(e) / time(c) = "
            f"{ratio('e', 'c2'):.2f}x  (target: metadist no slower, >= 1.0)"
        )
    if "l" in med:
        parts = (
            [f"parallel efficiency {ratio('a', 'l') / 2:.2f} (the ceiling)"] if "a" in med else []
        )
        parts += [
            f"time({k}) / time(l) = {ratio(k, 'l'):.2f}x" for k in ("c2", "k", "e") if k in med
        ]
        print("the limit (l): " + "; ".join(parts))
    if "c2" in med and "d" in med:
        print(f"time(d) / time(c) = {ratio('d', 'c2'):.2f}x  (target >= 1.35)")
    if "c2" in med and "d1" in med:
        print(f"time(d1) / time(c) = {ratio('d1', 'c2'):.2f}x")
    if args.out:  # bench_overhead.py --summary's names; variants with a failed round left out
        names = {"a": "plain", "a2": "plain 2T", "l": "limit", "e": "spmd W=2", "c2": "md W=2"}
        names.update({"k": "md ctx W=2", "d": "torchopt W=2"})
        kept = {
            names[k]: [t * 1e3 for t in r]  # type: ignore[operator]
            for k, r in rounds.items()
            if k in names and r and None not in r
        }
        if "plain" in kept:
            row = {"base": "plain", "rounds": kept}
            args.out.write_text(json.dumps({"workloads": {"conv MAML step": row}}))


if __name__ == "__main__":
    main()
