"""Goodness of fit without scipy: Pearson's chi-square and its p-value."""

from __future__ import annotations

import torch


def chi_square_pvalue(observed: torch.Tensor, expected_probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """P-value of Pearson's test that `observed` counts follow `expected_probs`.

    An outcome of probability 0 that occurred gives 0. Cells expected below `min_expected` are
    pooled into one (the test's usual validity condition).
    The p-value is the chi-square survival function, the regularized upper incomplete gamma
    Q(dof / 2, stat / 2).
    """
    observed = observed.double()
    total = observed.sum()
    expected = expected_probs.double() / expected_probs.double().sum() * total
    small = expected < min_expected
    if (observed[expected == 0] > 0).any():
        return 0.0  # an outcome the expected distribution cannot produce
    obs = torch.cat([observed[~small], observed[small].sum().reshape(1)])
    exp = torch.cat([expected[~small], expected[small].sum().reshape(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    dof = obs.numel() - 1
    assert dof >= 1, "need at least two cells"
    stat = ((obs - exp) ** 2 / exp).sum()
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))
