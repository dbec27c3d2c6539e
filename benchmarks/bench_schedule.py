"""Uneven tasks: a static against a dynamic schedule, and the ideal, on two workers.

Each task adapts a small MLP for a number of inner steps drawn per task (1 to 8, so one task
costs up to 8 times another) and returns its query loss; a meta-batch of ``--tasks`` tasks is
split one task per partition (``dim_partitioner(0, exclusive=True)``) over rank 0 (the caller,
in-process) and rank 1. Timed per step (forward and ``loss.backward()``), interleaved round by
round:

* ``static``: round-robin assignment fixed before anything runs (task i on worker i mod 2);
* ``dynamic``: ``schedule="dynamic"``, each task to the next worker that frees up;
* ``ideal``: the single-process time of the same step, halved.

Batches: ``skewed`` alternates long and short tasks (8, 1, 8, 1, ... inner steps: the
round-robin assignment gives one worker all the long ones, as a meta-batch built of hard/easy
pairs would); ``random`` draws 1-8 steps per task (seeded), where the static schedule's
imbalance is whatever the draw gives; ``even`` gives every task 4 steps. The script prints the
medians, the spread over rounds, the ratios against the targets (on the skewed batch dynamic
within 1.15x of ideal and >= 1.3x faster than static; on the even batch dynamic no slower than
1.03x static), and checks that both schedules give the same loss. ``--costs 8,1,1,1,8,1,1,1``
times that batch only (inner steps per task; target: dynamic >= 1.3x faster than static).

Run: ``python benchmarks/bench_schedule.py`` (``--quick`` for a smoke run; ``--json FILE`` saves
the skewed batch's rounds for ``bench_overhead.py --summary``, the single process as the
ideal's double). With
``--timeline DIR`` it also records one step of each schedule on the skewed batch with
:func:`metadist.timeline.record`, saves the Chrome traces and draws them side by side in
``DIR/timeline-schedules.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from torch import Tensor, nn

import metadist
from metadist.network import free_loopback_port

WIDTH = 128


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH))


def task_loss(model: nn.Module, x: Tensor, steps: Tensor) -> Tensor:
    """One task: ``steps`` differentiable inner SGD steps, then the query loss."""
    params = dict(model.named_parameters())
    for _ in range(int(steps.item())):
        loss = torch.func.functional_call(model, params, (x,)).pow(2).mean()
        grads = torch.autograd.grad(loss, list(params.values()), create_graph=True)
        params = {k: v - 0.01 * g for (k, v), g in zip(params.items(), grads, strict=True)}
    return torch.func.functional_call(model, params, (x,)).sub(1.0).pow(2).mean()


def batch(kind: str, tasks: int) -> tuple[Tensor, Tensor]:
    """``kind`` is even, skewed, random, or the inner steps themselves (``"8,1,1,1"``)."""
    if kind[0].isdigit():
        costs = [int(c) for c in kind.split(",")]
        return batch("even", len(costs))[0], torch.tensor(costs)
    g = torch.Generator().manual_seed(tasks)
    x = torch.randn(tasks, 512, WIDTH, generator=g)
    if kind == "even":
        steps = torch.full((tasks,), 4)
    elif kind == "skewed":
        steps = torch.tensor([8, 1] * (tasks // 2) + [8] * (tasks % 2))
    else:
        steps = torch.randint(1, 9, (tasks,), generator=g)
    return x, steps


def step(model: nn.Module, x: Tensor, steps: Tensor, schedule: str) -> Tensor:
    part = metadist.dim_partitioner(0, exclusive=True, schedule=schedule)
    loss = metadist.remote_sync_call(
        task_loss, args=(model, x, steps), partitioner=part, reducer=metadist.mean_reducer
    )
    loss.backward()
    return loss.detach()


def single(model: nn.Module, x: Tensor, steps: Tensor) -> None:
    loss = torch.stack([task_loss(model, x[i], steps[i]) for i in range(len(x))]).mean()
    loss.backward()


def _child(rank: int, port: int, cfg: dict[str, Any], out: str) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE="2",
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)

    @metadist.auto_init_rpc()
    def main() -> None:
        if rank != 0:
            return
        results: dict[str, Any] = {}
        model = make_model()
        if cfg.get("timeline"):
            x, steps = batch("skewed", cfg["tasks"])
            for schedule in ("static", "dynamic"):
                step(model, x, steps, schedule)  # warm up
                with metadist.timeline.record(Path(cfg["timeline"]) / f"{schedule}.json"):
                    step(model, x, steps, schedule)
        for kind in cfg["kinds"]:
            x, steps = batch(kind, cfg["tasks"])
            same = torch.equal(step(model, x, steps, "static"), step(model, x, steps, "dynamic"))
            timings: dict[str, list[float]] = {"static": [], "dynamic": [], "ideal": []}
            for r in range(cfg["rounds"]):
                order = ["static", "dynamic", "ideal"]
                for name in order if r % 2 == 0 else order[::-1]:
                    times = []
                    for _ in range(cfg["steps"]):
                        start = time.perf_counter()
                        if name == "ideal":
                            single(model, x, steps)
                        else:
                            step(model, x, steps, name)
                        elapsed = (time.perf_counter() - start) * 1e3
                        times.append(elapsed / 2 if name == "ideal" else elapsed)
                    timings[name].append(statistics.median(times))
            results[kind] = {"timings": timings, "same_loss": same, "steps": steps.tolist()}
        Path(out).write_text(json.dumps(results))

    main()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=16, help="tasks per meta-batch")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per round and variant")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    parser.add_argument("--quick", action="store_true", help="a smoke run")
    parser.add_argument("--timeline", type=Path, help="save traces and a timeline picture here")
    parser.add_argument(
        "--costs", help="time only this batch: inner steps per task, e.g. 8,1,1,1,8,1,1,1"
    )
    parser.add_argument("--json", type=Path, help="save the rounds' medians here")
    args = parser.parse_args()
    kinds = [args.costs] if args.costs else ["skewed", "random", "even"]
    cfg: dict[str, Any] = {
        "tasks": args.tasks,
        "steps": args.steps,
        "rounds": args.rounds,
        "kinds": kinds,
    }
    if args.timeline:
        args.timeline.mkdir(parents=True, exist_ok=True)
        cfg["timeline"] = str(args.timeline)
    if args.quick:
        cfg.update(steps=2, rounds=2)
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "out.json")
        mp.start_processes(
            _child, args=(free_loopback_port(), cfg, out), nprocs=2, start_method="spawn"
        )
        results = json.loads(Path(out).read_text())
    print(
        f"{len(results[kinds[0]]['steps'])} tasks of 1-8 inner steps on 2 workers (rank 0 "
        f"in-process + rank 1), 1 thread each; {cfg['rounds']} rounds x {cfg['steps']} steps; "
        f"ms per step"
    )
    for kind, res in results.items():
        t = res["timings"]
        med = {k: statistics.median(v) for k, v in t.items()}
        spread = {k: f"{min(v):.1f}-{max(v):.1f}" for k, v in t.items()}
        print(f"\n{kind} batch, inner steps {res['steps']}")
        for name in ("static", "dynamic", "ideal"):
            print(f"  {name:<8} {med[name]:8.1f}  [{spread[name]}]")
        ratios = [s / d for s, d in zip(t["static"], t["dynamic"], strict=True)]
        ideal = [d / i for d, i in zip(t["dynamic"], t["ideal"], strict=True)]
        r_static, r_ideal = statistics.median(ratios), statistics.median(ideal)

        def spread_of(values: list[float]) -> str:
            return f"[{min(values):.2f}-{max(values):.2f}]"

        if kind != "even":
            target = "  target >= 1.3" if kind != "random" else ""
            print(f"  static / dynamic   {r_static:5.2f} {spread_of(ratios)}{target}")
            target = "  target <= 1.15" if kind == "skewed" else ""
            print(f"  dynamic / ideal    {r_ideal:5.2f} {spread_of(ideal)}{target}")
        else:
            back = [1 / r for r in ratios]
            print(f"  dynamic / static   {1 / r_static:5.2f} {spread_of(back)}  target <= 1.03")
        print(f"  same loss under both schedules: {res['same_loss']}")
    if args.json and "skewed" in results:  # for bench_overhead.py --summary
        t = results["skewed"]["timings"]
        rounds = {"plain": [2 * i for i in t["ideal"]], "limit": t["ideal"]}
        rounds.update({"md static": t["static"], "md W=2": t["dynamic"]})
        row = {"base": "plain", "rounds": rounds}
        args.json.write_text(json.dumps({"workloads": {"uneven tasks": row}}))
    if args.timeline:
        picture = args.timeline / "timeline-schedules.png"
        draw_timelines([args.timeline / "static.json", args.timeline / "dynamic.json"], picture)
        print(f"\ntraces in {args.timeline}; picture {picture}")


def draw_timelines(traces: list[Path], picture: Path) -> None:
    """Draw Chrome traces written by metadist.timeline one above the other (a Gantt chart)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(traces), 1, figsize=(8, 1.6 * len(traces) + 0.6), sharex=True)
    for ax, path in zip(axes, traces, strict=True):
        events = json.loads(path.read_text())["traceEvents"]
        names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M"}
        lanes = sorted(names)
        for e in events:
            row = lanes.index(e["pid"]) if e["ph"] != "M" else None
            if e["ph"] == "X":
                ax.broken_barh([(e["ts"] / 1e3, e["dur"] / 1e3)], (row - 0.4, 0.8), edgecolor="k")
                ax.text(
                    (e["ts"] + e["dur"] / 2) / 1e3,
                    row,
                    e["name"].split("[")[1][:-1],
                    ha="center",
                    va="center",
                    fontsize=7,
                )
            elif e["ph"] == "i":
                ax.plot([e["ts"] / 1e3], [row + 0.45], "v", color="tab:red", markersize=4)
        ax.set_yticks(range(len(lanes)), [names[p] for p in lanes])
        ax.set_title(
            f"{path.stem} schedule (bars: task i forward on the worker; red: its gradients sent)",
            fontsize=9,
        )
    axes[-1].set_xlabel("ms since the first partition was sent")
    fig.tight_layout()
    fig.savefig(picture, dpi=120)


if __name__ == "__main__":
    main()
