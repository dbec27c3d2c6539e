"""Offline task sources of the few-shot example: generated glyphs and scikit-learn's digits.

Everything here is generated or bundled (no downloads), seeded, and sampled with an explicit
``numpy.random.Generator`` so a checkpoint can store the sampler's exact state. (The sinusoid
tasks are a few lines of ``sinusoid.py``.)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "DigitsDataset",
    "FewShotBatch",
    "GlyphDataset",
    "sample_fewshot",
]

IMAGE_SIZE = 28


def _render(curves: np.ndarray, width: np.ndarray) -> np.ndarray:
    """Rasterise strokes ``(B, S, P, 2)`` in [0, 1]^2 to ``(B, 28, 28)`` images in [0, 1].

    Each pen position is a Gaussian dot weighted by its share of the stroke's length, so a
    stroke renders as a line of peak ~1; the separable Gaussian turns the sum over positions
    into one batched matrix product per image instead of a (pixels x positions) distance table.
    """
    b = curves.shape[0]
    seg = np.linalg.norm(np.diff(curves, axis=2), axis=-1) * IMAGE_SIZE  # (B, S, P-1) pixels
    ds = np.concatenate([seg[..., :1], (seg[..., 1:] + seg[..., :-1]) / 2, seg[..., -1:]], -1)
    pts = curves.reshape(b, -1, 2) * IMAGE_SIZE - 0.5  # pixel coordinates
    sigma = width[:, None, None]
    centers = np.arange(IMAGE_SIZE, dtype=np.float32)[None, None, :]
    gx = np.exp(-((centers - pts[..., 0:1]) ** 2) / (2 * sigma**2))  # (B, S*P, 28)
    gy = np.exp(-((centers - pts[..., 1:2]) ** 2) / (2 * sigma**2))
    weight = ds.reshape(b, -1, 1) / (np.sqrt(2 * np.pi) * sigma)
    img = np.einsum("bpi,bpj->bij", gy * weight, gx)
    return np.clip(img, 0.0, 1.0).astype(np.float32)


def _bezier(ctrl: np.ndarray, n_points: int) -> np.ndarray:
    """Points of cubic Bezier curves: ``ctrl (..., 4, 2)`` -> ``(..., n_points, 2)``."""
    t = np.linspace(0.0, 1.0, n_points, dtype=np.float32)[:, None]
    p0, p1, p2, p3 = (ctrl[..., i : i + 1, :] for i in range(4))
    return (1 - t) ** 3 * p0 + 3 * (1 - t) ** 2 * t * p1 + 3 * (1 - t) * t**2 * p2 + t**3 * p3


class GlyphDataset:
    """Omniglot-like classes of random pen-stroke glyphs, generated from a seed.

    Each class is 1 to 4 cubic Bezier strokes, chained so they touch like handwriting. Its
    ``instances_per_class`` drawings (20, as in Omniglot) are the class strokes with jittered
    control points, a small random rotation, scale and shift, and a random pen width. Drawing
    ``j`` of class ``c`` depends only on ``(seed, c, j)``, so any process regenerates the same
    dataset without storing it. The first ``n_train`` classes are for meta-training, the rest
    for meta-testing (disjoint).

    Args:
        seed: Dataset seed.
        n_classes: Total number of classes.
        n_train: Number of meta-training classes.
        instances_per_class: Drawings per class.

    Raises:
        ValueError: If the class split leaves a side empty.

    Example:
        >>> ds = GlyphDataset(seed=0, n_classes=10, n_train=6)
        >>> ds.images(np.array([0, 7]), np.array([[0, 1], [2, 3]])).shape
        (2, 2, 1, 28, 28)
    """

    max_strokes = 4
    points_per_stroke = 32

    def __init__(
        self,
        seed: int = 0,
        n_classes: int = 4000,
        n_train: int = 3000,
        instances_per_class: int = 20,
    ) -> None:
        if not 0 < n_train < n_classes:
            raise ValueError(
                f"n_train: expected 0 < n_train < n_classes={n_classes}, got {n_train}"
            )
        self.seed = seed
        self.n_classes = n_classes
        self.n_train = n_train
        self.instances_per_class = instances_per_class
        rng = np.random.default_rng([seed, 0x61797068])
        n_strokes = rng.integers(1, self.max_strokes + 1, size=n_classes)
        ctrl = np.empty((n_classes, self.max_strokes, 4, 2), dtype=np.float32)
        start = rng.uniform(0.25, 0.75, size=(n_classes, 2))
        for s in range(self.max_strokes):
            # A stroke is a short random walk of control points; the next stroke starts on this
            # one, so glyphs are connected figures rather than scattered scribbles.
            steps = rng.normal(0.0, 0.18, size=(n_classes, 3, 2))
            pts = np.concatenate([start[:, None], start[:, None] + np.cumsum(steps, axis=1)], 1)
            ctrl[:, s] = np.clip(pts, 0.12, 0.88)
            start = ctrl[np.arange(n_classes), s, rng.integers(0, 4, size=n_classes)]
        # Unused stroke slots repeat stroke 0, which renders identically: fixed shapes, no masks.
        slot = np.arange(self.max_strokes)[None, :]
        ctrl = np.where((slot < n_strokes[:, None])[..., None, None], ctrl, ctrl[:, :1])
        # Centre each glyph's bounding box and fit it in 70% of the frame, like a scanned glyph.
        lo, hi = ctrl.min(axis=(1, 2)), ctrl.max(axis=(1, 2))  # (C, 2)
        scale = np.minimum(1.0, 0.7 / np.maximum(hi - lo, 1e-3).max(-1))[:, None, None, None]
        centre = ((lo + hi) / 2)[:, None, None, :]
        self._ctrl = ((ctrl - centre) * scale + 0.5).astype(np.float32)

    def classes(self, split: str) -> np.ndarray:
        """Class ids of ``split`` (``"train"`` or ``"test"``)."""
        if split == "train":
            return np.arange(self.n_train)
        if split == "test":
            return np.arange(self.n_train, self.n_classes)
        raise ValueError(f"split: expected 'train' or 'test', got {split!r}")

    def images(self, class_ids: np.ndarray, instance_ids: np.ndarray) -> np.ndarray:
        """Render drawings: ``class_ids (C,)``, ``instance_ids (C, M)`` -> ``(C, M, 1, 28, 28)``."""
        n_cls, m = instance_ids.shape
        ctrl = np.empty((n_cls, m, self.max_strokes, 4, 2), dtype=np.float32)
        affine = np.empty((n_cls, m, 5), dtype=np.float32)
        width = np.empty((n_cls, m), dtype=np.float32)
        for i, c in enumerate(class_ids):
            for j, inst in enumerate(instance_ids[i]):
                r = np.random.default_rng([self.seed, int(c), int(inst)])
                ctrl[i, j] = self._ctrl[c] + r.normal(0.0, 0.025, size=(self.max_strokes, 4, 2))
                affine[i, j] = [
                    r.uniform(-0.2, 0.2),  # rotation, radians
                    r.uniform(0.85, 1.1),  # scale
                    r.uniform(-0.06, 0.06),  # shift x
                    r.uniform(-0.06, 0.06),  # shift y
                    0.0,
                ]
                width[i, j] = r.uniform(0.6, 1.0)
        curves = _bezier(ctrl, self.points_per_stroke).reshape(n_cls * m, self.max_strokes, -1, 2)
        a = affine.reshape(n_cls * m, 5)
        cos, sin = np.cos(a[:, 0]) * a[:, 1], np.sin(a[:, 0]) * a[:, 1]
        rot = np.stack([np.stack([cos, -sin], -1), np.stack([sin, cos], -1)], -2)  # (B, 2, 2)
        curves = np.einsum("bij,bspj->bspi", rot, curves - 0.5) + 0.5 + a[:, None, None, 2:4]
        img = _render(curves, width.reshape(-1))
        return img.reshape(n_cls, m, 1, IMAGE_SIZE, IMAGE_SIZE)


class DigitsDataset:
    """scikit-learn's bundled 8x8 digits, upsampled to 28x28, split by class.

    Args:
        train_classes: Digits used for meta-training; the others are for meta-testing.

    Raises:
        ValueError: If a side of the split is empty or a class is not a digit.

    Example:
        >>> ds = DigitsDataset()
        >>> ds.classes("test").tolist()
        [5, 6, 7, 8, 9]
    """

    def __init__(self, train_classes: tuple[int, ...] = (0, 1, 2, 3, 4)) -> None:
        from sklearn.datasets import load_digits

        if not set(train_classes) < set(range(10)) or not train_classes:
            raise ValueError(
                f"train_classes: expected a proper subset of 0..9, got {train_classes}"
            )
        digits = load_digits()
        images = torch.from_numpy(digits.images.astype(np.float32) / 16.0)[:, None]
        images = torch.nn.functional.interpolate(
            images, size=(IMAGE_SIZE, IMAGE_SIZE), mode="bilinear", align_corners=False
        )
        self.train_classes = np.array(sorted(train_classes))
        self.test_classes = np.array(sorted(set(range(10)) - set(train_classes)))
        self.by_class = [images[digits.target == c].numpy() for c in range(10)]
        self.instances_per_class = min(len(v) for v in self.by_class)

    def classes(self, split: str) -> np.ndarray:
        """Class ids of ``split`` (``"train"`` or ``"test"``)."""
        if split == "train":
            return self.train_classes
        if split == "test":
            return self.test_classes
        raise ValueError(f"split: expected 'train' or 'test', got {split!r}")

    def images(self, class_ids: np.ndarray, instance_ids: np.ndarray) -> np.ndarray:
        """Look up images: ``class_ids (C,)``, ``instance_ids (C, M)`` -> ``(C, M, 1, 28, 28)``."""
        return np.stack(
            [self.by_class[c][idx] for c, idx in zip(class_ids, instance_ids, strict=False)]
        )


@dataclass(frozen=True)
class FewShotBatch:
    """A batch of N-way K-shot episodes; tensors have a leading task dimension ``T``.

    Attributes:
        x_spt: ``(T, N*K, 1, 28, 28)`` support images.
        y_spt: ``(T, N*K)`` support labels in ``[0, N)``.
        x_qry: ``(T, N*Q, 1, 28, 28)`` query images.
        y_qry: ``(T, N*Q)`` query labels.
    """

    x_spt: Tensor
    y_spt: Tensor
    x_qry: Tensor
    y_qry: Tensor


def sample_fewshot(
    dataset: GlyphDataset | DigitsDataset,
    split: str,
    rng: np.random.Generator,
    n_tasks: int,
    *,
    n_way: int = 5,
    k_shot: int = 1,
    k_query: int = 15,
) -> FewShotBatch:
    """Sample episodes: ``n_way`` classes of ``split``, ``k_shot`` + ``k_query`` drawings each.

    Labels are the order in which the classes were drawn, so a class has a different label in
    every episode and the model cannot memorise classes: it has to learn to adapt.

    Args:
        dataset: Where the images come from.
        split: ``"train"`` or ``"test"`` classes.
        rng: Source of randomness (advanced in place).
        n_tasks: Episodes ``T``.
        n_way: Classes per episode.
        k_shot: Support drawings per class.
        k_query: Query drawings per class.

    Returns:
        The batch (float32 images, int64 labels).

    Raises:
        ValueError: If the split has fewer than ``n_way`` classes or a class has fewer than
            ``k_shot + k_query`` drawings.

    Example:
        >>> ds = GlyphDataset(seed=0, n_classes=20, n_train=10)
        >>> b = sample_fewshot(ds, "test", np.random.default_rng(0), 2, n_way=3, k_query=2)
        >>> tuple(b.x_spt.shape), b.y_qry.tolist()
        ((2, 3, 1, 28, 28), [[0, 0, 1, 1, 2, 2], [0, 0, 1, 1, 2, 2]])
    """
    pool = dataset.classes(split)
    if len(pool) < n_way:
        raise ValueError(f"n_way: split {split!r} has {len(pool)} classes, fewer than {n_way}")
    per_class = k_shot + k_query
    if per_class > dataset.instances_per_class:
        raise ValueError(
            f"k_shot + k_query: expected at most {dataset.instances_per_class} drawings per class,"
            f" got {per_class}"
        )
    xs, xq = [], []
    for _ in range(n_tasks):
        cls = rng.choice(pool, size=n_way, replace=False)
        inst = np.stack(
            [rng.choice(dataset.instances_per_class, size=per_class, replace=False) for _ in cls]
        )
        img = dataset.images(cls, inst)  # (N, K+Q, 1, 28, 28)
        xs.append(img[:, :k_shot].reshape(-1, *img.shape[2:]))
        xq.append(img[:, k_shot:].reshape(-1, *img.shape[2:]))
    labels = torch.arange(n_way)
    return FewShotBatch(
        x_spt=torch.from_numpy(np.stack(xs)),
        y_spt=labels.repeat_interleave(k_shot).repeat(n_tasks, 1),
        x_qry=torch.from_numpy(np.stack(xq)),
        y_qry=labels.repeat_interleave(k_query).repeat(n_tasks, 1),
    )
