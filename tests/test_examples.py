"""The MAML examples: data and inner-loop units in-process, then end-to-end under torchrun."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F  # noqa: N812 - the usual torch alias
from _dist import REPO, run_torchrun

EXAMPLES = REPO / "examples" / "maml"
sys.path.insert(0, str(EXAMPLES))

import data as maml_data  # noqa: E402
import metalearn  # noqa: E402
import models  # noqa: E402


def _load(path: Path) -> dict[str, object]:
    return torch.load(path, map_location="cpu", weights_only=False)  # type: ignore[no-any-return]


def _params_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ----------------------------------------------------------------------------- units, no RPC


def test_sinusoid_tasks_follow_the_paper_ranges() -> None:
    b = maml_data.sample_sinusoid(np.random.default_rng(0), 200, 10, 7)
    assert b.x_spt.shape == (200, 10, 1)
    assert b.y_qry.shape == (200, 7, 1)
    assert b.amplitude.min() >= 0.1
    assert b.amplitude.max() <= 5.0
    assert b.phase.min() >= 0.0
    assert b.phase.max() <= np.pi
    assert b.x_spt.min() >= -5.0
    assert b.x_qry.max() <= 5.0
    want = b.amplitude[:, None, None] * torch.sin(b.x_qry - b.phase[:, None, None])
    torch.testing.assert_close(b.y_qry, want, rtol=1e-5, atol=1e-5)


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


def test_vmap_and_loop_meta_gradients_agree_with_autograd() -> None:
    torch.manual_seed(0)
    net = models.SineMLP()
    b = maml_data.sample_sinusoid(np.random.default_rng(1), 6)
    args = (b.x_spt, b.y_spt, b.x_qry, b.y_qry, F.mse_loss)
    grads = []
    for vectorize in (True, False):
        loss, _ = metalearn.meta_objective(net, *args, steps=2, lr=0.01, vectorize=vectorize)
        grads.append(torch.autograd.grad(loss, list(net.parameters())))
    # Hand-written second-order MAML with torch.autograd.grad(create_graph=True).
    params = list(net.parameters())
    total = 0.0
    for t in range(6):
        fast = params
        for _ in range(2):
            names = [n for n, _ in net.named_parameters()]
            out = torch.func.functional_call(net, dict(zip(names, fast, strict=True)), b.x_spt[t])
            g = torch.autograd.grad(F.mse_loss(out, b.y_spt[t]), fast, create_graph=True)
            fast = [p - 0.01 * gi for p, gi in zip(fast, g, strict=True)]
        out = torch.func.functional_call(net, dict(zip(names, fast, strict=True)), b.x_qry[t])
        total = total + F.mse_loss(out, b.y_qry[t]) / 6
    want = torch.autograd.grad(total, params)
    for got in grads:
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    # First order differs from second order (the second-order terms are really there).
    loss, _ = metalearn.meta_objective(net, *args, steps=2, lr=0.01, first_order=True)
    fo = torch.autograd.grad(loss, list(net.parameters()))
    assert not all(torch.allclose(a, b) for a, b in zip(fo, want, strict=True))


def test_checkpoint_round_trip_restores_sampler(tmp_path: Path) -> None:
    net = models.ConvNet(n_way=3)
    opt = torch.optim.Adam(net.parameters())
    rng = np.random.default_rng(0)
    rng.random(5)
    metalearn.save_checkpoint(
        tmp_path / "c.pt", model=net, optimizer=opt, step=7, rng=rng, history={"x": [1.0]}, args={}
    )
    expected = rng.random(3)
    fresh_rng = np.random.default_rng(123)
    fresh = models.ConvNet(n_way=3)
    step, hist = metalearn.load_checkpoint(
        tmp_path / "c.pt",
        model=fresh,
        optimizer=torch.optim.Adam(fresh.parameters()),
        rng=fresh_rng,
    )
    assert (step, hist) == (7, {"x": [1.0]})
    np.testing.assert_array_equal(fresh_rng.random(3), expected)
    assert _params_equal(dict(fresh.state_dict()), dict(net.state_dict()))
    with pytest.raises(FileNotFoundError, match="resume"):
        metalearn.load_checkpoint(tmp_path / "missing.pt", model=net, optimizer=opt, rng=rng)


# ----------------------------------------------------------------------------- end to end


@pytest.mark.timeout(150)
def test_sinusoid_trains_on_two_workers_and_resumes_exactly(tmp_path: Path) -> None:
    full, half = tmp_path / "full", tmp_path / "resumed"
    common = ("--eval-tasks", "100", "--save-every", "200")
    proc = run_torchrun(
        EXAMPLES / "sinusoid.py", 2, "--steps", "400", "--out", str(full), *common, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (full / "learning_curve.png").stat().st_size > 10_000
    ckpt = _load(full / "checkpoint.pt")
    curve = ckpt["history"]["query MSE"]  # type: ignore[index]
    assert ckpt["step"] == 400
    assert len(curve) == 400
    assert np.mean(curve[-50:]) < 0.8 * np.mean(curve[:50])  # seed 0: ratio 0.63
    summary = json.loads((full / "summary.json").read_text())
    assert summary["workers"] == 2
    assert "MAML" in proc.stdout
    assert "pretrained" in proc.stdout
    # Resuming from the step-200 checkpoint reproduces the straight run bit for bit.
    proc = run_torchrun(
        EXAMPLES / "sinusoid.py", 2, "--steps", "400", "--out", str(half), "--no-eval",
        "--resume", str(full / "checkpoint-000200.pt"), timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    resumed = _load(half / "checkpoint.pt")
    assert resumed["history"] == ckpt["history"]
    assert _params_equal(resumed["model"], ckpt["model"])  # type: ignore[arg-type]


@pytest.mark.timeout(200)
def test_fewshot_trains_on_two_workers_and_resumes_exactly(tmp_path: Path) -> None:
    small = ("--tasks", "4", "--query", "3")
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
