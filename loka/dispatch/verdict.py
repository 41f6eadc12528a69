"""The A/B rule of :func:`~loka.dispatch.optimize`: whether alternating whole-step timings of
the baseline and a plan keep the plan.

A plan that wins every one of the first ``rounds`` rounds is kept. One noisy round (a host
that drifted, a slow first step) used to throw a faster plan away; now a lost round lets
up to ``rounds`` more be timed, and the plan is kept where its wins pass a one-sided sign
test at the level of winning all ``rounds`` and its median step is the faster
(:func:`ab_verdict`). Rounds are added only after a loss, so the rule's own chance of
keeping a plan no faster than the baseline is above the test's level
(:func:`null_keep_probability`, exact).
"""

from __future__ import annotations

import math
import statistics
from typing import List, Optional

__all__ = ["ab_verdict", "sign_test_p", "null_keep_probability"]


def _ratio(rounds: List[dict], base_key: str, plan_key: str) -> Optional[float]:
    if not rounds or not all(base_key in r and plan_key in r for r in rounds):
        return None
    base = statistics.median(r[base_key] for r in rounds)
    mine = statistics.median(r[plan_key] for r in rounds)
    return base / mine if mine > 0 else None


def sign_test_p(wins: int, n: int) -> float:
    """``P(X >= wins)`` for ``X ~ Binomial(n, 1/2)``: how often a plan no faster than the
    baseline, each round a fair coin, would win at least ``wins`` of ``n`` rounds."""
    if not 0 <= wins <= n:
        raise ValueError(f"sign_test_p needs 0 <= wins <= n, got wins={wins}, n={n}")
    return sum(math.comb(n, k) for k in range(wins, n + 1)) / 2 ** n


def _timings_ok(rounds: List[dict]) -> bool:
    return all(math.isfinite(r[k]) and r[k] > 0 for r in rounds for k in ("baseline", "plan"))


def _wins(rounds: List[dict]) -> int:
    return sum(1 for r in rounds if r["plan"] < r["baseline"])  # a tie is no win


def _sign_verdict(wins: int, n: int, first: int) -> Optional[bool]:
    """:func:`ab_verdict` on counts alone (``wins`` of ``n`` rounds), the median aside."""
    level = 0.5 ** first
    if sign_test_p(wins, n) <= level:
        return True
    if any(sign_test_p(wins + extra, n + extra) <= level
           for extra in range(1, 2 * first - n + 1)):
        return None
    return False


def ab_verdict(rounds: List[dict], first: int) -> Optional[bool]:
    """Whether A/B ``rounds`` (``{"baseline": ms, "plan": ms}`` each; the first ``first``
    timed up front, at most ``first`` more after a loss) keep the plan: True where its wins
    pass a one-sided sign test at ``0.5 ** first`` (the evidence of winning all ``first``
    rounds; one loss then needs about ``first`` extra wins) and its median step is the
    faster; False where no number of further rounds within ``2 * first`` can get there;
    None where more rounds could decide. A step time that is not a positive finite number
    (NaN, Inf, 0) gives False. Rounds are added only after a loss, so the test's
    level is not the rule's: :func:`null_keep_probability` is how often it keeps a plan no
    faster than the baseline."""
    if first < 1 or len(rounds) < first:
        raise ValueError(f"ab_verdict needs at least first={first} >= 1 rounds, got "
                         f"{len(rounds)}")
    if not _timings_ok(rounds):  # a broken timing says nothing: keep nothing on it
        return False
    verdict = _sign_verdict(_wins(rounds), len(rounds), first)
    if verdict:
        ratio = _ratio(rounds, "baseline", "plan")
        return ratio is not None and ratio > 1.0
    return verdict


def ab_note(rounds: List[dict], first: int) -> Optional[str]:
    """The plan's note on its decided A/B ``rounds`` (:func:`ab_verdict` True or False):
    why they put it back on the baseline, or, where it passed after a lost round, how;
    None where it won every one of the ``first`` rounds."""
    wins, n = _wins(rounds), len(rounds)
    extra = "" if n == first else f" ({n - first} timed after a lost round)"
    if ab_verdict(rounds, first):
        return (None if n == first else
                f"optimize: the plan won {wins} of {n} A/B rounds{extra}: a sign test at the "
                f"level of winning all {first}")
    if not _timings_ok(rounds):
        return f"optimize: an A/B round's step time was not a positive finite number{extra}"
    if _sign_verdict(wins, n, first):
        return (f"optimize: the plan won {wins} of {n} A/B rounds{extra}, but its median step "
                f"was not faster than the baseline's")
    return (f"optimize: the plan's step was faster than the baseline's in {wins} of {n} A/B "
            f"rounds{extra}, short of winning all {first} or a sign test at that level")


def null_keep_probability(first: int) -> float:
    """How often :func:`optimize`'s A/B rule keeps a plan whose step is no faster than the
    baseline's, each round then won with even odds: ``0.5 ** first`` (every round won)
    plus the chance of passing after a lost round (exact, over the rule's own stopping;
    the median's condition aside, which can only lower it). For 3 rounds 11/64 = 0.172,
    against 8/64 = 0.125 under the every-round rule; for 4, 3/32 against 1/16."""
    if first < 1:
        raise ValueError(f"null_keep_probability needs first >= 1, got {first}")
    states = {w: math.comb(first, w) / 2 ** first for w in range(first + 1)}  # after `first`
    kept, n = 0.0, first
    while states:
        nxt: dict = {}
        for wins, prob in states.items():
            verdict = _sign_verdict(wins, n, first)
            if verdict:
                kept += prob
            elif verdict is None:  # one more round, won or lost with even odds
                for w in (wins, wins + 1):
                    nxt[w] = nxt.get(w, 0.0) + prob / 2
        states, n = nxt, n + 1
    return kept
