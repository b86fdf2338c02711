"""Intervals and the paired agreement test of ArS vs SpS scores (Theorem 1 says the two
modes sample one distribution, so their mean score difference is 0)."""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

ALPHA = 0.05  # the agreement test's significance level; intervals are 95%
Z = 1.959963984540054  # two-sided normal quantile for ALPHA


def mean_ci(values: Sequence[float]) -> dict:
    """Mean and the half-width of its 95% normal-approximation interval."""
    x = np.asarray(values, dtype=np.float64)
    half = Z * x.std(ddof=1) / math.sqrt(len(x)) if len(x) > 1 else float("nan")
    return {"mean": float(x.mean()), "ci95": float(half), "n": int(len(x))}


def paired_agreement(a: Sequence[float], b: Sequence[float]) -> dict:
    """Two-sided paired z-test of mean(a - b) = 0 over items, at level ALPHA.

    Per-item score differences of ArS and SpS: SpS samples the target's distribution
    exactly, so the true mean difference is 0 and the test rejects with probability ALPHA."""
    d = np.asarray(a, np.float64) - np.asarray(b, np.float64)
    mean, sd = float(d.mean()), float(d.std(ddof=1)) if len(d) > 1 else float("nan")
    if not sd > 0:  # identical scores on every item (e.g. greedy), or a single item
        p = 1.0 if mean == 0 or math.isnan(sd) else 0.0
        return {"difference": mean, "ci95": 0.0 if sd == 0 else float("nan"), "p_value": p, "agree": p > ALPHA,
                "alpha": ALPHA}
    se = sd / math.sqrt(len(d))
    p = math.erfc(abs(mean / se) / math.sqrt(2))
    return {"difference": mean, "ci95": Z * se, "p_value": p, "agree": p > ALPHA, "alpha": ALPHA}
