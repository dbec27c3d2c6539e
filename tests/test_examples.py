"""The MAML examples: data, inner loop, options and checkpoints in-process, then end-to-end
under torchrun, including a worker killed under ``torchrun --max-restarts``."""

from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F  # noqa: N812 - the usual torch alias
from _dist import REPO, run_command, run_torchrun

EXAMPLES = REPO / "examples" / "maml"
sys.path.insert(0, str(EXAMPLES))

import data as maml_data  # noqa: E402
import fewshot  # noqa: E402
import maml  # noqa: E402
import models  # noqa: E402
import sinusoid  # noqa: E402
import training  # noqa: E402


def _load(path: Path) -> dict[str, object]:
    return torch.load(path, map_location="cpu", weights_only=False)  # type: ignore[no-any-return]


def _params_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ----------------------------------------------------------------------------- units, no RPC


def test_sinusoid_tasks_follow_the_paper_ranges() -> None:
    x_spt, y_spt, x_qry, y_qry = sinusoid.sample_tasks(np.random.default_rng(0), 200, 10, 7)
    assert x_spt.shape == y_spt.shape == (200, 10, 1)
    assert x_qry.shape == y_qry.shape == (200, 7, 1)
    # The same draws, in the sampler's order: amplitude, phase, then the points.
    rng = np.random.default_rng(0)
    amplitude = torch.from_numpy(rng.uniform(0.1, 5.0, (200, 1, 1))).float()
    phase = torch.from_numpy(rng.uniform(0.0, np.pi, (200, 1, 1))).float()
    assert amplitude.min() >= 0.1
    assert amplitude.max() <= 5.0
    assert phase.min() >= 0.0
    assert phase.max() <= np.pi
    assert x_spt.min() >= -5.0
    assert x_qry.max() <= 5.0
    for x, y in ((x_spt, y_spt), (x_qry, y_qry)):
        torch.testing.assert_close(y, amplitude * torch.sin(x - phase), rtol=1e-5, atol=1e-5)


def test_glyphs_are_seeded_split_and_class_consistent() -> None:
    ds = maml_data.GlyphDataset(seed=3)
    again = maml_data.GlyphDataset(seed=3)
    other = maml_data.GlyphDataset(seed=4)
    assert ds.n_classes >= 2000
    train, test = set(ds.classes("train").tolist()), set(ds.classes("test").tolist())
    assert not train & test
    assert len(train | test) == ds.n_classes
    ids, inst = np.array([5, 3500]), np.array([[0, 1, 2], [0, 1, 2]])
    img = ds.images(ids, inst)
    assert img.shape == (2, 3, 1, 28, 28)
    assert img.dtype == np.float32
    assert img.min() >= 0.0
    assert img.max() <= 1.0
    assert img.max() > 0.9
    np.testing.assert_array_equal(img, again.images(ids, inst))
    assert not np.array_equal(img, other.images(ids, inst))
    # Drawings of one class resemble each other more than drawings of another class.
    flat = img.reshape(2, 3, -1)
    within = np.linalg.norm(flat[0, 0] - flat[0, 1])
    across = np.linalg.norm(flat[0, 0] - flat[1, 0])
    assert within < across
    b = maml_data.sample_fewshot(ds, "test", np.random.default_rng(0), 3, n_way=5, k_query=2)
    assert b.x_spt.shape == (3, 5, 1, 28, 28)
    assert b.x_qry.shape == (3, 10, 1, 28, 28)
    assert b.y_spt.tolist() == [[0, 1, 2, 3, 4]] * 3
    with pytest.raises(ValueError, match="n_way"):
        maml_data.sample_fewshot(ds, "train", np.random.default_rng(0), 1, n_way=4000)


def test_digits_split_by_class() -> None:
    ds = maml_data.DigitsDataset()
    assert ds.classes("train").tolist() == [0, 1, 2, 3, 4]
    assert ds.classes("test").tolist() == [5, 6, 7, 8, 9]
    b = maml_data.sample_fewshot(ds, "test", np.random.default_rng(0), 2, n_way=5, k_query=3)
    assert b.x_qry.shape == (2, 15, 1, 28, 28)
    with pytest.raises(ValueError, match="train_classes"):
        maml_data.DigitsDataset(train_classes=tuple(range(10)))


def test_meta_gradients_agree_with_hand_written_second_order_maml() -> None:
    # sinusoid.py's meta-loss (vmap over its own inner loop) and maml.py's meta_objective (vmap,
    # or a loop), against torch.autograd.grad(create_graph=True) written out task by task.
    torch.manual_seed(0)
    net = sinusoid.SineMLP()
    x_spt, y_spt, x_qry, y_qry = tasks = sinusoid.sample_tasks(np.random.default_rng(1), 6)
    args = (*tasks, F.mse_loss)
    plain_meta_loss = inspect.unwrap(sinusoid.meta_loss)  # without metadist: no RPC here
    losses = [
        maml.meta_objective(net, *args, steps=2, lr=0.01, vectorize=vectorize)[0]
        for vectorize in (True, False)
    ]
    losses.append(plain_meta_loss(net, *tasks, inner_lr=0.01, inner_steps=2, first_order=False))
    grads = [torch.autograd.grad(loss, list(net.parameters())) for loss in losses]
    params = list(net.parameters())
    names = [n for n, _ in net.named_parameters()]
    total = 0.0
    for t in range(6):
        fast = params
        for _ in range(2):
            out = torch.func.functional_call(net, dict(zip(names, fast, strict=True)), x_spt[t])
            g = torch.autograd.grad(F.mse_loss(out, y_spt[t]), fast, create_graph=True)
            fast = [p - 0.01 * gi for p, gi in zip(fast, g, strict=True)]
        out = torch.func.functional_call(net, dict(zip(names, fast, strict=True)), x_qry[t])
        total = total + F.mse_loss(out, y_qry[t]) / 6
    want = torch.autograd.grad(total, params)
    for got in grads:
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    # First order differs from second order (the second-order terms are really there).
    for loss in (
        maml.meta_objective(net, *args, steps=2, lr=0.01, first_order=True)[0],
        plain_meta_loss(net, *tasks, inner_lr=0.01, inner_steps=2, first_order=True),
    ):
        fo = torch.autograd.grad(loss, list(net.parameters()))
        assert not all(torch.allclose(a, b) for a, b in zip(fo, want, strict=True))


def test_checkpoint_round_trip_restores_sampler(tmp_path: Path) -> None:
    net = models.ConvNet(n_way=3)
    opt = torch.optim.Adam(net.parameters())
    rng = np.random.default_rng(0)
    rng.random(5)
    training.save_checkpoint(
        tmp_path / "c.pt", model=net, optimizer=opt, step=7, rng=rng, history={"x": [1.0]}, args={}
    )
    expected = rng.random(3)
    fresh_rng = np.random.default_rng(123)
    fresh = models.ConvNet(n_way=3)
    step, hist = training.load_checkpoint(
        tmp_path / "c.pt",
        model=fresh,
        optimizer=torch.optim.Adam(fresh.parameters()),
        rng=fresh_rng,
    )
    assert (step, hist) == (7, {"x": [1.0]})
    np.testing.assert_array_equal(fresh_rng.random(3), expected)
    assert _params_equal(dict(fresh.state_dict()), dict(net.state_dict()))
    with pytest.raises(FileNotFoundError, match="resume"):
        training.load_checkpoint(tmp_path / "missing.pt", model=net, optimizer=opt, rng=rng)


def test_auto_resume_takes_the_newest_checkpoint_that_loads(tmp_path: Path) -> None:
    net = sinusoid.SineMLP(hidden=4)
    opt = torch.optim.Adam(net.parameters())
    rng = np.random.default_rng(0)
    for step in (100, 200):
        training.save_checkpoint(
            tmp_path / f"checkpoint-{step:06d}.pt",
            model=net, optimizer=opt, step=step, rng=rng, history={}, args={},
        )  # fmt: skip
    assert training.latest_checkpoint(tmp_path) == tmp_path / "checkpoint-000200.pt"
    # A writer killed before its rename leaves only a temporary file, which is never picked.
    (tmp_path / ".checkpoint-000300.pt.tmp").write_bytes(b"half a checkpoint")
    # A file cut short by something else (a full disk, a copy) is skipped, not fatal.
    good = (tmp_path / "checkpoint-000200.pt").read_bytes()
    (tmp_path / "checkpoint-000400.pt").write_bytes(good[: len(good) // 2])
    assert training.latest_checkpoint(tmp_path) == tmp_path / "checkpoint-000200.pt"
    assert not list(tmp_path.glob("checkpoint-000300*"))
    assert training.latest_checkpoint(tmp_path / "missing") is None


def _parsers() -> list[argparse.ArgumentParser]:
    return [sinusoid.build_parser(), fewshot.build_parser()]


@pytest.mark.parametrize("parser", _parsers(), ids=["sinusoid", "fewshot"])
def test_every_option_has_help_and_shows_its_default(parser: argparse.ArgumentParser) -> None:
    text = " ".join(parser.format_help().split())
    actions = parser._actions  # argparse has no public list of a parser's options
    for action in actions:
        assert action.help, f"{action.option_strings}: no help text"
        assert action.option_strings[-1] in text
    # Every option that takes a value shows its default; on/off flags are off by default.
    assert text.count("(default:") == sum(action.nargs != 0 for action in actions)
    assert "(default: auto)" in text


def test_plain_run_resumes_automatically_and_refuses_another_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    small = ["--plain", "--tasks", "5", "--hidden", "8", "--no-eval", "--threads", "1"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    sinusoid.main([*small, "--steps", "30", "--out", str(straight)])
    sinusoid.main([*small, "--steps", "20", "--save-every", "10", "--out", str(split)])
    sinusoid.main([*small, "--steps", "30", "--out", str(split)])  # --resume auto: from step 20
    want, got = _load(straight / "checkpoint.pt"), _load(split / "checkpoint.pt")
    assert got["step"] == 30
    assert got["history"] == want["history"]
    assert _params_equal(got["model"], want["model"])  # type: ignore[arg-type]
    trained = json.loads((split / "summary.json").read_text())
    assert trained["trained_steps"] == 10  # the resumed process ran steps 20 to 30
    assert trained["ms_per_step"] > 0
    # Running a finished run again trains and writes nothing but its summary, says so, and the
    # summary keeps the timing of the run that trained (strict JSON: no NaN anywhere).
    capsys.readouterr()
    files = {f: f.stat().st_mtime_ns for f in split.iterdir() if f.name != "summary.json"}
    sinusoid.main([*small, "--steps", "30", "--out", str(split)])
    out = capsys.readouterr().out
    assert "nothing to train" in out
    assert "wrote no checkpoint" in out
    assert "keeps the timing of the run that trained: 10 steps" in out
    assert "wrote checkpoint" not in out.replace("wrote no checkpoint", "")
    assert "nan" not in out.lower()
    assert {f: f.stat().st_mtime_ns for f in split.iterdir() if f.name != "summary.json"} == files
    again = json.loads(
        (split / "summary.json").read_text(),
        parse_constant=lambda name: pytest.fail(f"summary.json holds {name}, not JSON"),
    )
    for key in ("trained_steps", "seconds", "ms_per_step", "ms_per_step_p10_p90", "mode"):
        assert again[key] == trained[key], key
    # Different options in the same --out: auto-resume refuses, with one message and status 2,
    # rather than mixing two runs.
    with pytest.raises(SystemExit) as refused:
        sinusoid.main([*small[:2], "6", *small[3:], "--steps", "40", "--out", str(split)])
    assert refused.value.code == 2
    assert "--tasks 5 vs 6" in capsys.readouterr().err
    with pytest.raises(SystemExit) as refused:
        sinusoid.main([*small, "--resume", str(tmp_path / "missing.pt"), "--out", str(split)])
    assert refused.value.code == 2
    assert "missing.pt: no such checkpoint file" in capsys.readouterr().err
    # fewshot's --plain evaluates without metadist too.
    fewshot.main(
        ["--plain", "--steps", "2", "--tasks", "2", "--query", "2", "--eval-tasks", "4",
         "--threads", "1", "--out", str(tmp_path / "fewshot")]
    )  # fmt: skip
    summary = json.loads((tmp_path / "fewshot" / "summary.json").read_text())
    assert 0.0 <= summary["meta_test_accuracy"][0] <= 1.0
    assert summary["mode"] == "plain torch"
    assert "versus_plain" not in summary  # --plain has nothing to compare with


def test_a_refused_resume_ends_the_job_with_one_message_and_no_traceback(
    tmp_path: Path,
) -> None:
    """--workers checks --resume before any worker starts; under torchrun, every rank checks
    before RPC starts, so neither waits for the other."""
    small = ["--tasks", "5", "--hidden", "8", "--no-eval", "--threads", "1", "--out", str(tmp_path)]
    sinusoid.main(["--plain", *small, "--steps", "3"])
    other = [*small[:1], "6", *small[2:], "--steps", "6"]
    proc = run_command([sys.executable, str(EXAMPLES / "sinusoid.py"), "--workers", "2", *other])
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.count("comes from a run with other options (--tasks 5 vs 6)") == 1
    assert "Traceback" not in proc.stdout + proc.stderr
    # Under torchrun itself every rank exits with status 2 and rank 0 prints the message
    # (torchrun then reports the failed ranks in its own way).
    proc = run_torchrun(EXAMPLES / "sinusoid.py", 2, *other, timeout=60)
    assert proc.returncode != 0
    assert proc.stderr.count("comes from a run with other options (--tasks 5 vs 6)") == 1
    assert "exitcode: 2" in proc.stderr


# ----------------------------------------------------------------------------- end to end


@pytest.mark.timeout(150)
def test_sinusoid_trains_on_two_workers_and_resumes_exactly(tmp_path: Path) -> None:
    full, half = tmp_path / "full", tmp_path / "resumed"
    workload = ("--steps", "400", "--tasks", "25", "--meta-lr", "1e-3")  # Finn et al.'s batch
    proc = run_torchrun(
        EXAMPLES / "sinusoid.py", 2, *workload, "--out", str(full), "--eval-tasks", "100",
        "--save-every", "200", timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (full / "learning_curve.png").stat().st_size > 10_000
    ckpt = _load(full / "checkpoint.pt")
    curve = ckpt["history"]["query MSE"]  # type: ignore[index]
    assert ckpt["step"] == 400
    assert len(curve) == 400
    assert np.mean(curve[-50:]) < 0.8 * np.mean(curve[:50])  # seed 0: ratio 0.63
    summary = json.loads((full / "summary.json").read_text())
    assert summary["workers"] == 2
    assert summary["ms_per_step"] > 0
    assert "ms per step" in proc.stdout
    # --compare-plain 20 (the default): steps 20, 40, ... after the warm-up, run in plain torch
    # too, the first of them untimed; a clearly slower thread count is left out after 5.
    versus = summary["versus_plain"]
    assert max(versus["plain_steps"].values()) == 400 // 20 - 2
    assert min(versus["plain_steps"].values()) >= 5
    assert 5 <= versus["steps"] <= 400 // 20 - 2
    assert {"1", str(len(os.sched_getaffinity(0)))} == set(versus["plain_ms_per_step"])
    assert all(ms > 0 for ms in versus["plain_ms_per_step"].values())
    fastest = min(versus["plain_ms_per_step"].values())
    assert versus["speedup"] == pytest.approx(fastest / versus["ms_per_step"])
    assert "plain torch in one process" in proc.stdout
    assert "than plain torch at its fastest here" in proc.stdout
    assert "MAML" in proc.stdout
    assert "pretrained" in proc.stdout
    # Resuming from the step-200 checkpoint reproduces the straight run bit for bit.
    proc = run_torchrun(
        EXAMPLES / "sinusoid.py", 2, *workload, "--out", str(half), "--no-eval",
        "--resume", str(full / "checkpoint-000200.pt"), timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    resumed = _load(half / "checkpoint.pt")
    assert resumed["history"] == ckpt["history"]
    assert _params_equal(resumed["model"], ckpt["model"])  # type: ignore[arg-type]


@pytest.mark.timeout(200)
def test_fewshot_trains_on_two_workers_and_resumes_exactly(tmp_path: Path) -> None:
    small = ("--tasks", "4", "--query", "3", "--compare-plain", "0")
    proc = run_torchrun(
        EXAMPLES / "fewshot.py", 2, "--steps", "12", *small, "--save-every", "6",
        "--eval-tasks", "8", "--out", str(tmp_path), timeout=90,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "learning_curve.png").stat().st_size > 10_000
    ckpt = _load(tmp_path / "checkpoint.pt")
    loss = ckpt["history"]["query loss"]  # type: ignore[index]
    assert ckpt["step"] == 12
    assert len(loss) == 12
    assert np.mean(loss[-4:]) < np.mean(loss[:4])
    assert "meta-test accuracy" in proc.stdout
    fresh = models.ConvNet(n_way=5)
    fresh.load_state_dict(ckpt["model"])  # type: ignore[arg-type]
    # Resuming from the step-6 checkpoint reproduces the straight run bit for bit (BatchNorm
    # statistics, Adam state and the task sampler included).
    half = tmp_path / "resumed"
    proc = run_torchrun(
        EXAMPLES / "fewshot.py", 2, "--steps", "12", *small, "--no-eval", "--out", str(half),
        "--resume", str(tmp_path / "checkpoint-000006.pt"), timeout=90,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    resumed = _load(half / "checkpoint.pt")
    assert resumed["history"] == ckpt["history"]
    assert _params_equal(resumed["model"], ckpt["model"])  # type: ignore[arg-type]


def _pids_of(marker: str, rank: int) -> list[int]:
    """Workers of this test's first torchrun attempt with the given rank (found by environment)."""
    want = {f"MAML_TEST_RUN={marker}", f"RANK={rank}", "TORCHELASTIC_RESTART_COUNT=0"}
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = set((entry / "environ").read_bytes().decode(errors="replace").split("\0"))
        except OSError:  # gone, or not ours
            continue
        if want <= env:
            found.append(int(entry.name))
    return found


@pytest.mark.timeout(120)
def test_sinusoid_resumes_bit_exactly_after_a_worker_is_killed(tmp_path: Path) -> None:
    """torchrun --max-restarts=1 restarts both workers after worker 1 is SIGKILLed; rank 0
    resumes from the newest checkpoint and ends where an uninterrupted run ends."""
    steps, every = 300, 50
    common = ("--steps", str(steps), "--tasks", "25", "--save-every", str(every), "--no-eval")
    straight = run_torchrun(
        EXAMPLES / "sinusoid.py", 2, *common, "--out", str(tmp_path / "straight"), timeout=60
    )
    assert straight.returncode == 0, straight.stdout + straight.stderr

    out, marker = tmp_path / "killed", uuid.uuid4().hex
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--max-restarts=1",
        "--nproc_per_node=2", str(EXAMPLES / "sinusoid.py"), *common, "--out", str(out),
    ]  # fmt: skip
    env = {**os.environ, "MAML_TEST_RUN": marker, "PYTHONUNBUFFERED": "1"}
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        cwd=REPO, start_new_session=True,
    ) as job:  # fmt: skip
        try:
            # Part-way: once the step-100 checkpoint exists, with 200 steps still to go.
            deadline = time.monotonic() + 60
            while not (out / "checkpoint-000100.pt").exists():
                assert job.poll() is None, "the job ended before its step-100 checkpoint"
                assert time.monotonic() < deadline, "no step-100 checkpoint within 60 s"
                time.sleep(0.02)
            victims = _pids_of(marker, rank=1)
            assert len(victims) == 1, victims
            os.kill(victims[0], signal.SIGKILL)
            stdout, stderr = job.communicate(timeout=90)
        finally:
            if job.poll() is None:
                os.killpg(job.pid, signal.SIGKILL)
                job.communicate()
    assert job.returncode == 0, stdout + stderr
    resumed = re.findall(r"resuming from \S+ at step (\d+)", stdout)
    assert len(resumed) == 1, stdout  # one restart, and it resumed from a checkpoint
    assert 100 <= int(resumed[0]) < steps
    assert "exitcode: -9" in stderr  # the agent saw worker 1 die while the job ran
    want, got = _load(tmp_path / "straight" / "checkpoint.pt"), _load(out / "checkpoint.pt")
    assert got["step"] == want["step"] == steps
    assert got["history"] == want["history"]
    assert _params_equal(got["model"], want["model"])  # type: ignore[arg-type]
    assert got["optimizer"]["state"].keys() == want["optimizer"]["state"].keys()  # type: ignore[index]
    for key, state in want["optimizer"]["state"].items():  # type: ignore[index]
        for name, value in state.items():
            assert torch.equal(got["optimizer"]["state"][key][name], value), (key, name)  # type: ignore[index]
