"""FID and KID from Inception features, as torchmetrics defines them (FrechetInceptionDistance,
KernelInceptionDistance), in float64.

FID: ``||mu_1 - mu_2||^2 + tr(S_1) + tr(S_2) - 2 tr(sqrt(S_1 S_2))`` with unbiased covariances, the trace
of the matrix square root taken as the sum of the square roots of the eigenvalues of ``S_1 S_2``
(torchmetrics' way: no scipy ``sqrtm`` iteration, and defined when the covariances are singular); with
fewer images than the 2048 feature dimensions the same eigenvalues come from a small symmetric matrix
(``fid`` says how), which is faster and more accurate than a 2048 x 2048 non-symmetric eigendecomposition.

KID: the unbiased squared MMD with the polynomial kernel ``(x.y / d + 1)^3`` over ``subsets`` random
subsets of ``subset_size`` features of each set (torchmetrics' defaults 100 and 1000; the subset size is
cut to the smaller set), reported as mean and standard deviation. Subsets are drawn from a seeded
generator, so KID is reproducible for the same features.
"""

from __future__ import annotations

import numpy as np
import torch


def statistics(features: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and unbiased covariance (float64) of (N, D) features."""
    x = torch.as_tensor(features, dtype=torch.float64)
    if len(x) < 2:
        raise ValueError(f"FID needs at least 2 images per set, got {len(x)}")
    mean = x.mean(0)
    centred = x - mean
    return mean, centred.T @ centred / (len(x) - 1)


def frechet_distance(mu1: torch.Tensor, sigma1: torch.Tensor, mu2: torch.Tensor, sigma2: torch.Tensor) -> float:
    """The Fréchet distance between N(mu1, sigma1) and N(mu2, sigma2), torchmetrics' _compute_fid."""
    a = (mu1 - mu2).square().sum()
    b = sigma1.trace() + sigma2.trace()
    c = torch.linalg.eigvals(sigma1 @ sigma2).sqrt().real.sum()
    return float(a + b - 2 * c)


def fid(features1: np.ndarray, features2: np.ndarray) -> float:
    """FID of two (N, D) feature sets. With fewer images than dimensions (small proxy evaluations) the
    trace term is taken from the same eigenvalues by a smaller, symmetric route: for centred features X
    (n x D), S1 = X'X / (n - 1) and the non-zero eigenvalues of S1 S2 are those of the n x n PSD matrix
    X S2 X' / (n - 1), so eigvalsh of that replaces a non-symmetric D x D eigendecomposition (seconds
    per call at D = 2048 on a CPU)."""
    mu1, sigma1 = statistics(features1)
    mu2, sigma2 = statistics(features2)
    small, other = (features1, sigma2) if len(features1) <= len(features2) else (features2, sigma1)
    if len(small) >= sigma1.shape[0]:
        return frechet_distance(mu1, sigma1, mu2, sigma2)
    x = torch.as_tensor(small, dtype=torch.float64)
    x = x - x.mean(0)
    inner = torch.linalg.eigvalsh(x @ other @ x.T / (len(x) - 1))
    c = inner.clamp(min=0).sqrt().sum()
    return float((mu1 - mu2).square().sum() + sigma1.trace() + sigma2.trace() - 2 * c)


def poly_mmd(f_real: torch.Tensor, f_fake: torch.Tensor, degree: int = 3, gamma: float | None = None,
             coef: float = 1.0) -> float:
    """Unbiased squared MMD with the polynomial kernel (torchmetrics' poly_mmd)."""
    gamma = 1.0 / f_real.shape[1] if gamma is None else gamma
    k_11 = (f_real @ f_real.T * gamma + coef) ** degree
    k_22 = (f_fake @ f_fake.T * gamma + coef) ** degree
    k_12 = (f_real @ f_fake.T * gamma + coef) ** degree
    m = f_real.shape[0]
    kt_xx_sum = k_11.sum() - k_11.diagonal().sum()
    kt_yy_sum = k_22.sum() - k_22.diagonal().sum()
    value = (kt_xx_sum + kt_yy_sum) / (m * (m - 1)) - 2 * k_12.sum() / m**2
    return float(value)


def kid(real: np.ndarray, fake: np.ndarray, subsets: int = 100, subset_size: int = 1000,
        seed: int = 0) -> tuple[float, float]:
    """KID mean and standard deviation over ``subsets`` random subsets of equal size of both sets."""
    f_real = torch.as_tensor(real, dtype=torch.float64)
    f_fake = torch.as_tensor(fake, dtype=torch.float64)
    size = min(subset_size, len(f_real), len(f_fake))
    if size < 2:
        raise ValueError(f"KID needs at least 2 images per set, got {len(f_real)} and {len(f_fake)}")
    generator = torch.Generator().manual_seed(seed)
    values = []
    for _ in range(subsets):
        pick_real = torch.randperm(len(f_real), generator=generator)[:size]
        pick_fake = torch.randperm(len(f_fake), generator=generator)[:size]
        values.append(poly_mmd(f_real[pick_real], f_fake[pick_fake]))
    scores = torch.tensor(values, dtype=torch.float64)
    return float(scores.mean()), float(scores.std(unbiased=False))
