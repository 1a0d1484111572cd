"""pass@k: the chance that at least one of k samples, drawn without replacement from n samples of
which c are correct, is correct. The unbiased estimator of Chen et al. (2021):

    pass@k = 1 − C(n − c, k) / C(n, k)

computed as 1 − Π_{i = n−c+1}^{n} (1 − k / i), which never forms the large binomials. Averaged
over problems it is the benchmark's pass@k; the paper's coding run reports LiveCodeBench pass@4.
"""

from __future__ import annotations

import math


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one problem with ``c`` correct among ``n`` samples (1 <= k <= n)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def pass_at_ks(n: int, c: int) -> dict[int, float]:
    """pass@k for every k in 1..n."""
    return {k: pass_at_k(n, c, k) for k in range(1, n + 1)}
