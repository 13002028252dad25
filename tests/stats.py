"""Pearson chi-square goodness-of-fit, for tests that compare sampled tokens with a distribution."""

from __future__ import annotations

import math

import torch

# Chi-square tests: significance level 0.001, critical values from the Wilson-Hilferty approximation.
ALPHA_Z = 3.090  # standard normal quantile at 1 - 0.001


def chi2_critical(df: int, z: float = ALPHA_Z) -> float:
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2_statistic(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic, cells with expected count < 5 pooled into one; returns (stat, df)."""
    n = counts.sum().item()
    expected = probs * n
    big = expected >= 5
    obs = torch.cat([counts[big].double(), counts[~big].double().sum()[None]])
    exp = torch.cat([expected[big].double(), expected[~big].double().sum()[None]])
    keep = exp > 0
    stat = (((obs - exp) ** 2) / exp)[keep].sum().item()
    return stat, int(keep.sum().item()) - 1
