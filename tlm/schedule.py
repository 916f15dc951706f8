"""Per-layer MLP widths for Tapered Language Models (TLM).

A tapered model gives layer ``l`` (``l = 0 .. L-1``) its own MLP width ``d_ff(l)`` while keeping the
total width, and hence the MLP parameter count and FLOPs, of a uniform model of width ``D``:
``sum(d_ff) == L * D`` exactly. `taper_widths` resolves a schedule spec into that list of ints.

Schedules (``SCHEDULES``)
-------------------------
Continuous schedules (``"cosine"`` (default), ``"linear"``, ``"sigmoid"``) interpolate from the
first-layer width ``a`` to the last-layer width ``b``::

    d(l) = a - (a - b) * p(t_l),    t_l = l / (L - 1)

with a non-decreasing profile ``p`` that has ``p(0) = 0``, ``p(1) = 1`` and is point-symmetric,
``p(1 - t) = 1 - p(t)``, so ``d(l) + d(L-1-l) = a + b`` and the mean is exactly ``(a + b) / 2 = D``:

* cosine: ``p(t) = (1 - cos(pi t)) / 2`` (flat ends, steepest mid-stack; note the ``L - 1`` denominator);
* linear: ``p(t) = t``;
* sigmoid: the logistic ``s(t) = 1 / (1 + exp(-k (t - 1/2)))`` normalised to the endpoints,
  ``p(t) = (s(t) - s(0)) / (s(1) - s(0))``; steepness ``k > 0`` (default 10), ``k -> 0`` tends to
  linear, large ``k`` to a step at mid-depth. Evaluated in the equivalent form
  ``1/2 + tanh(k (t - 1/2) / 2) / (2 tanh(k / 4))``, which stays accurate for tiny ``k``.

The ratio ``(r_s, r_e)`` gives ``a ~ r_s D`` and ``b ~ r_e D``; it must satisfy ``r_s, r_e > 0`` and
``r_s + r_e = 2`` (the budget). ``r_s > r_e`` is a normal taper (non-increasing widths); a reverse taper
``r_s < r_e`` (non-decreasing widths) is accepted with a warning, since the paper reports that it hurts.

``"uniform"`` returns ``[D] * L``. ``"three-group"`` splits the stack into contiguous front / middle / back
groups of ``n_f = n_b = L // 3`` and ``n_m = L - 2 (L // 3)`` layers with widths ``m_g D``; the three
multipliers must satisfy ``n_f m_f + n_m m_m + n_b m_b = L``. Presets: wider-early ``(1.5, 1, 0.5)``
(in budget for any L), wider-middle ``(0.75, 1.5, 0.75)`` (only when 3 divides L), wider-late
``(0.5, 1, 1.5)``. An explicit list of ints is validated and returned as a new list.

Two grouped shapes put every layer in a wide or a narrow group; the ratio ``A/B`` (both > 0) is the
proportion of a wide layer's width to a narrow one's, scaled to the budget: ``w_wide = A c``,
``w_narrow = B c`` with ``c = L D / (A n_wide + B n_narrow)`` (so 1.5/0.5 makes wide layers three
times as wide as narrow ones, whatever the group sizes):

* ``"x-shape"``: the first and last thirds (``L // 3`` layers each) wide, the middle narrow (wide
  early *and* late, as Variable-Width Transformers propose);
* ``"middle-heavy"``: the middle ``round(0.7 L)`` layers wide, the rest (split as evenly as possible,
  the extra one at the back) narrow (MLP capacity concentrated mid-stack, as layerwise FFN-importance
  studies find).

`measured_widths` turns a per-layer profile (e.g. what removing each layer's neurons costs, measured
on calibration text) into widths at the same budget: ``w_l = clip(lam p_l, lo D, hi D)`` with ``lam``
chosen so the widths sum to ``L D``, optionally after a non-increasing least-squares fit of ``p``
(``monotone``: a taper).

Rounding with exact repair
--------------------------
Widths are multiples of ``q`` (``multiple_of``), which must divide ``D``. The endpoints are pinned:
``a = q * round_half_up(r_s D / q)`` and ``b = 2 D - a`` (so odd ``D`` works with ``q = 1``). With
``u[l] = w[l] / q`` the exact widths in units of ``q``, every width is rounded half up,
``n[l] = floor(u[l] + 1/2)`` (monotone, so the order is kept), the endpoints are set to ``a/q`` and
``b/q``, and the remaining ``r = L D / q - sum(n)`` units are placed on interior layers one at a time:

* ``r > 0``: add a unit to the layer with the largest deficit ``u - n`` (ties: smallest ``l``) among
  those that can grow without breaking the order;
* ``r < 0``: remove a unit from the layer with the largest excess ``n - u`` (ties: largest ``l``) among
  those that can shrink without breaking the order.

The tie-breaks favour early capacity. Afterwards the invariants are checked explicitly: the exact sum,
the order, the pinned endpoints, multiples of ``q`` and ``|d - w| <= q`` (continuous schedules).
Three-group widths use the same repair without order guards (a width never drops below ``q``). Grouped and
measured widths round every layer half up and then repair over all layers (largest deficit or excess
first, within their bounds and, for a monotone profile, keeping the order).

This module is copied next to checkpoints as transformers remote code, so it imports only the
standard library.
"""

import logging
import math
import warnings
from collections.abc import Sequence

logger = logging.getLogger(__name__)

SCHEDULES = ("cosine", "linear", "sigmoid", "uniform", "three-group", "x-shape", "middle-heavy")
_CONTINUOUS = ("cosine", "linear", "sigmoid")
_GROUPED = ("x-shape", "middle-heavy")
MIDDLE_HEAVY_SHARE = 0.7  # the share of layers that "middle-heavy" widens
_BUDGET_TOL = 1e-9  # tolerance on r_s + r_e == 2 and on the three-group budget
_HALF_EPS = 1e-9  # computed half-unit ties (x.4999999999) still round up
_KEY_DIGITS = 9  # repair keys are rounded so float noise does not override the index tie-break
_NON_INCREASING = "non-increasing"
_NON_DECREASING = "non-decreasing"


# ----------------------------------------------------------------------------------------------
# public API
# ----------------------------------------------------------------------------------------------


def parse_ratio(text_or_seq) -> tuple[float, ...]:
    """Parse a width ratio: ``"1.5/0.5"`` / ``"1.5/1/0.5"`` or a sequence of numbers -> tuple of floats.

    Only the form is checked here (at least two finite numbers); `taper_widths` checks the count and
    the budget for the chosen schedule. Raises ValueError on anything else.
    """
    if isinstance(text_or_seq, str):
        return _parse_ratio_text(text_or_seq)
    if not isinstance(text_or_seq, Sequence):
        raise ValueError(
            f"ratio={text_or_seq!r} is not a ratio; expected a string of the form 'A/B' (e.g. '1.5/0.5'; "
            f"'A/B/C' for three-group) or a sequence of numbers"
        )
    values = tuple(_ratio_number(x, text_or_seq) for x in text_or_seq)
    if len(values) < 2:
        raise ValueError(
            f"ratio={tuple(text_or_seq)!r} needs at least two values: (start, end) such as (1.5, 0.5), "
            f"or (front, middle, back) for three-group"
        )
    return values


def taper_widths(
    num_layers: int,
    base_width: int,
    schedule: "str | Sequence[int]" = "cosine",
    ratio: "str | Sequence[float]" = (1.5, 0.5),
    multiple_of: int = 16,
    steepness: float = 10.0,
) -> list[int]:
    """Per-layer MLP widths whose sum is exactly ``num_layers * base_width``.

    Args:
        num_layers: L >= 1.
        base_width: D >= 1, the uniform baseline width (the mean of the result).
        schedule: one of ``SCHEDULES`` ("cosine", "linear", "sigmoid", "uniform", "three-group",
            "x-shape", "middle-heavy"; case-insensitive, "_" accepted for "-") or an explicit list/tuple of L ints, each >= 1 and a
            multiple of ``multiple_of``, summing to L*D (returned as a new list).
        ratio: (r_s, r_e) for the continuous schedules, with r_s, r_e > 0 and r_s + r_e == 2
            (r_s < r_e is a reverse taper and warns); three multipliers (front, middle, back) for
            "three-group"; (wide, narrow) width proportions for "x-shape" and "middle-heavy". A string
            "1.5/0.5" (or "1.5/1/0.5") is parsed. Ignored by "uniform" and explicit lists.
        multiple_of: q >= 1; every width is a multiple of q, and q must divide D for named schedules.
        steepness: k > 0 of the "sigmoid" schedule (logistic slope in units of depth fraction:
            k -> 0 tends to linear, large k to a step at mid-depth); ignored by the other schedules.

    Returns:
        list of L ints: monotone in the taper's direction (continuous schedules), first and last widths
        pinned at ``q * round_half_up(r_s D / q)`` and ``2 D`` minus that; grouped shapes equal within a
        group up to one unit of q.

    Raises:
        ValueError: for any request that cannot be met; the message names the argument, its value and
            what is allowed.
    """
    _check_int_at_least("num_layers", num_layers, 1)
    _check_int_at_least("base_width", base_width, 1)
    _check_int_at_least("multiple_of", multiple_of, 1)
    if not isinstance(schedule, str):
        return _explicit_widths(schedule, num_layers, base_width, multiple_of)
    name = _schedule_name(schedule)
    _check_divides(multiple_of, base_width)
    if name == "uniform":
        return [base_width] * num_layers
    if name == "three-group":
        return _three_group_widths(num_layers, base_width, parse_ratio(ratio), multiple_of)
    if name in _GROUPED:
        return _grouped_widths(name, num_layers, base_width, parse_ratio(ratio), multiple_of)
    k = _check_steepness(steepness) if name == "sigmoid" else steepness
    r_s, r_e = _two_point_ratio(parse_ratio(ratio))
    if r_s < r_e:
        warnings.warn(
            f"ratio=({r_s!r}, {r_e!r}) is a reverse taper (narrow early layers, wide late layers); "
            f"the TLM paper reports that it hurts; use it for ablations only",
            UserWarning,
            stacklevel=2,
        )
    return _continuous_widths(name, num_layers, base_width, r_s, r_e, multiple_of, k)


# ----------------------------------------------------------------------------------------------
# profiles
# ----------------------------------------------------------------------------------------------


def _cosine_profile(t: float) -> float:
    return (1.0 - math.cos(math.pi * t)) / 2.0


def _linear_profile(t: float) -> float:
    return t


def _sigmoid_profile(t: float, k: float = 10.0) -> float:
    """Endpoint-normalised logistic of steepness k: p(0) = 0, p(1) = 1, p(1 - t) = 1 - p(t)."""
    return 0.5 + math.tanh(k * (t - 0.5) / 2.0) / (2.0 * math.tanh(k / 4.0))


def _profile(name: str, t: float, steepness: float = 10.0) -> float:
    """Profile p(t) of the continuous schedule `name` at depth fraction t in [0, 1]."""
    if name == "cosine":
        return _cosine_profile(t)
    if name == "linear":
        return _linear_profile(t)
    if name == "sigmoid":
        return _sigmoid_profile(t, steepness)
    raise ValueError(f"schedule={name!r} has no profile; expected one of {', '.join(_CONTINUOUS)}")


# ----------------------------------------------------------------------------------------------
# validation helpers
# ----------------------------------------------------------------------------------------------


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int_at_least(name: str, value, low: int) -> None:
    if not _is_int(value) or value < low:
        raise ValueError(f"{name}={value!r} is not allowed; expected an integer >= {low}")


def _check_divides(multiple_of: int, base_width: int) -> None:
    if base_width % multiple_of:
        raise ValueError(
            f"multiple_of={multiple_of} does not divide base_width={base_width}; use multiple_of=1 "
            f"or a base width that is a multiple of {multiple_of}"
        )


def _schedule_name(schedule: str) -> str:
    name = schedule.strip().lower().replace("_", "-")
    if name not in SCHEDULES:
        raise ValueError(
            f"schedule={schedule!r} is unknown; expected one of {', '.join(SCHEDULES)} "
            f"or an explicit list of per-layer widths"
        )
    return name


def _check_steepness(steepness) -> float:
    if isinstance(steepness, bool) or not isinstance(steepness, (int, float)) or not (
        math.isfinite(steepness) and steepness > 0
    ):
        raise ValueError(
            f"steepness={steepness!r} is not allowed for the sigmoid schedule; expected a finite number > 0 "
            f"(default 10; small values approach the linear schedule)"
        )
    return float(steepness)


def _parse_ratio_text(text: str) -> tuple[float, ...]:
    parts = text.split("/")
    bad = ValueError(
        f"ratio={text!r} is malformed; expected the form 'A/B' with numbers A, B (e.g. '1.5/0.5'), "
        f"or 'A/B/C' for three-group (e.g. '1.5/1/0.5')"
    )
    if len(parts) < 2:
        raise bad
    try:
        values = tuple(float(p) for p in parts)
    except ValueError:
        raise bad from None
    if not all(math.isfinite(v) for v in values):
        raise bad
    return values


def _ratio_number(x, whole) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
        raise ValueError(
            f"ratio={tuple(whole)!r} is not allowed: {x!r} is not a finite number; expected numbers "
            f"such as (1.5, 0.5) or the string '1.5/0.5'"
        )
    return float(x)


def _fmt(values: Sequence[float]) -> str:
    return "(" + ", ".join(repr(float(v)) for v in values) + ")"


def _two_point_ratio(ratio: tuple[float, ...]) -> tuple[float, float]:
    if len(ratio) != 2:
        raise ValueError(
            f"ratio={_fmt(ratio)} has {len(ratio)} values; the continuous schedules take two, "
            f"start and end, in the form 'A/B' (e.g. 1.5/0.5)"
        )
    r_s, r_e = ratio
    if r_s <= 0 or r_e <= 0:
        raise ValueError(f"ratio={_fmt(ratio)}: start and end must both be > 0 (e.g. 1.5/0.5)")
    if abs(r_s + r_e - 2.0) > _BUDGET_TOL:
        raise ValueError(
            f"ratio={_fmt(ratio)}: start and end must sum to 2 to keep the parameter budget (e.g. 1.5/0.5)"
        )
    return r_s, r_e


# ----------------------------------------------------------------------------------------------
# rounding and repair
# ----------------------------------------------------------------------------------------------


def _round_half_up(x: float) -> int:
    return math.floor(x + 0.5 + _HALF_EPS)


def _can_grow(n: list[int], l: int, order) -> bool:
    if order == _NON_INCREASING:
        return n[l - 1] > n[l]
    if order == _NON_DECREASING:
        return n[l + 1] > n[l]
    return True


def _can_shrink(n: list[int], l: int, order) -> bool:
    if order == _NON_INCREASING:
        return n[l] > n[l + 1]
    if order == _NON_DECREASING:
        return n[l] > n[l - 1]
    return n[l] > 1


def _pick(candidates: list[int], key, prefer_last: bool):
    """The candidate with the largest key; ties go to the smallest index (largest if prefer_last)."""
    best = None
    for l in candidates:
        k = round(key(l), _KEY_DIGITS)
        if best is None or k > best[0] or (prefer_last and k == best[0]):
            best = (k, l)
    return None if best is None else best[1]


def _repair(n: list[int], u: list[float], target: int, order, what: str) -> list[int]:
    """Place the missing (or surplus) units of q on interior layers so sum(n) == target."""
    n = list(n)
    interior = range(1, len(n) - 1)
    r = target - sum(n)
    if r:
        logger.debug("width repair: %s needs %+d unit(s) after rounding", what, r)
    while r:
        if r > 0:
            l = _pick([i for i in interior if _can_grow(n, i, order)], lambda i: u[i] - n[i], False)
        else:
            l = _pick([i for i in interior if _can_shrink(n, i, order)], lambda i: n[i] - u[i], True)
        if l is None:
            raise ValueError(
                f"cannot round {what} to an exact total: {abs(r)} unit(s) of multiple_of are left to "
                f"{'add' if r > 0 else 'remove'} and no interior layer can take them; use a smaller "
                f"multiple_of or a different ratio"
            )
        step = 1 if r > 0 else -1
        n[l] += step
        r -= step
    return n


# ----------------------------------------------------------------------------------------------
# builders
# ----------------------------------------------------------------------------------------------


def _endpoints(r_s: float, base_width: int, q: int, ratio_text: str, num_layers: int) -> tuple[int, int]:
    a = q * _round_half_up(r_s * base_width / q)
    b = 2 * base_width - a
    for which, width in (("first", a), ("last", b)):
        if width < 1 and num_layers >= 2:
            raise ValueError(
                f"ratio={ratio_text} with base_width={base_width}, multiple_of={q} gives a {which}-layer "
                f"width of {width}; every width must be >= 1: use a milder ratio (e.g. 1.5/0.5), a smaller "
                f"multiple_of or a larger base_width"
            )
    return a, b


def _continuous_widths(
    name: str, num_layers: int, base_width: int, r_s: float, r_e: float, q: int, k: float
) -> list[int]:
    ratio_text = _fmt((r_s, r_e))
    a, b = _endpoints(r_s, base_width, q, ratio_text, num_layers)
    if num_layers == 1:
        return [base_width]
    if a != r_s * base_width:
        logger.debug("%s schedule: first width %s rounded to %d (multiple_of=%d)", name, r_s * base_width, a, q)
    last = num_layers - 1
    w = [a - (a - b) * _profile(name, l / last, k) for l in range(num_layers)]
    w[0], w[last] = float(a), float(b)
    u = [x / q for x in w]
    n = [_round_half_up(x) for x in u]
    n[0], n[last] = a // q, b // q
    order = _NON_INCREASING if a >= b else _NON_DECREASING
    what = (
        f"the {name} schedule (num_layers={num_layers}, base_width={base_width}, multiple_of={q}, "
        f"ratio={ratio_text})"
    )
    n = _repair(n, u, num_layers * base_width // q, order, what)
    widths = [q * x for x in n]
    _check_invariants(widths, w, num_layers * base_width, q, (a, b), order, what, check_error=True)
    logger.debug("%s -> %s", what, widths)
    return widths


def _group_sizes(num_layers: int) -> tuple[int, int, int]:
    n_f = num_layers // 3
    return n_f, num_layers - 2 * n_f, n_f


def _three_group_budget_error(ratio, num_layers, sizes, total) -> ValueError:
    n_f, n_m, n_b = sizes
    msg = (
        f"ratio={_fmt(ratio)} with num_layers={num_layers} (groups {n_f}/{n_m}/{n_b}): "
        f"n_f*m_f + n_m*m_m + n_b*m_b = {total:g} but must equal num_layers={num_layers} to keep the "
        f"parameter budget"
    )
    if n_f and n_b:
        side = (num_layers - n_m * ratio[1]) / (n_f + n_b)
        if side > 0:
            msg += f"; e.g. keep m_m={ratio[1]:g} and use m_f = m_b = {side:g}"
    else:
        msg += f"; with fewer than 3 layers every layer is in the middle group, so use m_m=1"
    return ValueError(msg)


def _three_group_widths(num_layers: int, base_width: int, ratio: tuple[float, ...], q: int) -> list[int]:
    if len(ratio) != 3:
        raise ValueError(
            f"ratio={_fmt(ratio)} has {len(ratio)} values; the three-group schedule takes three "
            f"multipliers (front, middle, back) in the form 'A/B/C' (e.g. 1.5/1/0.5)"
        )
    if min(ratio) <= 0:
        raise ValueError(f"ratio={_fmt(ratio)}: three-group multipliers must all be > 0 (e.g. 1.5/1/0.5)")
    sizes = _group_sizes(num_layers)
    total = sum(s * m for s, m in zip(sizes, ratio))
    if abs(total - num_layers) > _BUDGET_TOL:
        raise _three_group_budget_error(ratio, num_layers, sizes, total)
    group_units = []
    for label, size, m in zip(("front", "middle", "back"), sizes, ratio):
        units = _round_half_up(m * base_width / q)
        if size and units < 1:
            raise ValueError(
                f"ratio={_fmt(ratio)} with base_width={base_width}, multiple_of={q} gives a {label}-group "
                f"width of {q * units}; every width must be >= 1: use larger multipliers, a smaller "
                f"multiple_of or a larger base_width"
            )
        group_units.append(units)
    u = [m * base_width / q for size, m in zip(sizes, ratio) for _ in range(size)]
    n = [units for size, units in zip(sizes, group_units) for _ in range(size)]
    what = (
        f"the three-group schedule (num_layers={num_layers}, base_width={base_width}, multiple_of={q}, "
        f"ratio={_fmt(ratio)})"
    )
    n = _repair(n, u, num_layers * base_width // q, None, what)
    widths = [q * x for x in n]
    ends = (q * n[0], q * n[-1]) if num_layers < 3 else (q * group_units[0], q * group_units[2])
    _check_invariants(widths, [q * x for x in u], num_layers * base_width, q, ends, None, what)
    logger.debug("%s -> %s", what, widths)
    return widths


def _wide_layers(name: str, num_layers: int) -> list[bool]:
    """Which layers the grouped shape ``name`` widens."""
    if name == "x-shape":
        third = num_layers // 3
        return [l < third or l >= num_layers - third for l in range(num_layers)]
    middle = _round_half_up(MIDDLE_HEAVY_SHARE * num_layers)
    front = (num_layers - middle) // 2
    return [front <= l < front + middle for l in range(num_layers)]


def _grouped_widths(name: str, num_layers: int, base_width: int, ratio: tuple[float, ...], q: int) -> list[int]:
    if len(ratio) != 2 or min(ratio) <= 0:
        raise ValueError(
            f"ratio={_fmt(ratio)} is not allowed for the {name} schedule; expected two numbers > 0, the wide and "
            f"narrow width proportions, in the form 'A/B' (e.g. 1.5/0.5: wide layers three times as wide)"
        )
    weights = [ratio[0] if wide else ratio[1] for wide in _wide_layers(name, num_layers)]
    total = num_layers * base_width
    u = [x * total / (sum(weights) * q) for x in weights]
    what = (
        f"the {name} schedule (num_layers={num_layers}, base_width={base_width}, multiple_of={q}, "
        f"ratio={_fmt(ratio)})"
    )
    widths = [q * x for x in _round_and_fill(u, total // q, 1, total // q, None, what)]
    _check_invariants(widths, [q * x for x in u], total, q, (widths[0], widths[-1]), None, what, check_error=True)
    logger.debug("%s -> %s", what, widths)
    return widths


def measured_widths(
    profile: Sequence[float],
    base_width: int,
    multiple_of: int = 16,
    bounds: "Sequence[float]" = (0.5, 1.5),
    monotone: bool = False,
) -> list[int]:
    """Per-layer widths summing to ``len(profile) * base_width``, proportional to ``profile`` within bounds.

    ``w_l = clip(lam * p_l, lo * D, hi * D)`` with the one ``lam`` that makes the widths sum to ``L * D``,
    rounded to multiples of ``multiple_of`` with the exact repair. ``monotone`` first replaces ``p`` by its
    closest non-increasing sequence (least squares, pool-adjacent-violators), so the widths are a taper.

    Args:
        profile: L >= 1 finite numbers >= 0 (a layer's share of the model's important neurons, say);
            enough of them > 0 that the upper bound can hold the budget.
        base_width: D, the mean width.
        multiple_of: q, dividing D.
        bounds: (lo, hi) with 0 < lo <= 1 <= hi: the narrowest and widest layer as multiples of D.
        monotone: keep the widths non-increasing with depth.

    Raises:
        ValueError: a bad argument, or a profile that cannot fill the budget within the bounds.
    """
    _check_int_at_least("base_width", base_width, 1)
    _check_int_at_least("multiple_of", multiple_of, 1)
    _check_divides(multiple_of, base_width)
    p = _check_profile(profile)
    lo, hi = _check_bounds(bounds)
    q, L = multiple_of, len(p)
    if monotone:
        p = _non_increasing_fit(p)
    p = [x / max(p) for x in p]  # scale-free: lam lies in [0, high / the smallest positive entry]
    low, high = math.ceil(lo * base_width / q - _HALF_EPS), math.floor(hi * base_width / q + _HALF_EPS)
    target = L * base_width // q
    if sum(high if x > 0 else low for x in p) < target or low > base_width // q:
        raise ValueError(
            f"profile={list(profile)!r} cannot fill num_layers*base_width={L * base_width} within bounds "
            f"{_fmt((lo, hi))} x base_width: too few layers score above 0; raise the upper bound or measure "
            f"on more calibration text"
        )
    u = _scaled_clipped(p, low, high, target)
    what = f"measured widths (profile={[round(x, 6) for x in p]}, base_width={base_width}, multiple_of={q})"
    order = _NON_INCREASING if monotone else None
    widths = [q * x for x in _round_and_fill(u, target, low, high, order, what)]
    _check_invariants(widths, [q * x for x in u], L * base_width, q, (widths[0], widths[-1]), order, what)
    if any(w < q * low or w > q * high for w in widths):
        raise RuntimeError(f"internal error building {what}: a width is outside the bounds; widths={widths}")
    return widths


def _check_profile(profile) -> list[float]:
    if not isinstance(profile, Sequence) or isinstance(profile, str) or not profile:
        raise ValueError(f"profile={profile!r} is not allowed; expected a non-empty list of numbers >= 0")
    for l, x in enumerate(profile):
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x < 0:
            raise ValueError(f"profile entry {l} ({x!r}) is not allowed; every entry must be a finite number >= 0")
    if not any(profile):
        raise ValueError("profile is all zeros; nothing tells the layers apart (measure on calibration text)")
    return [float(x) for x in profile]


def _check_bounds(bounds) -> tuple[float, float]:
    values = tuple(bounds) if isinstance(bounds, Sequence) and not isinstance(bounds, str) else ()
    if len(values) != 2 or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in values) or not (
        0 < values[0] <= 1 <= values[1] and math.isfinite(values[1])
    ):
        raise ValueError(f"bounds={bounds!r} is not allowed; expected (lo, hi) with 0 < lo <= 1 <= hi, e.g. (0.5, 1.5)")
    return float(values[0]), float(values[1])


def _non_increasing_fit(p: list[float]) -> list[float]:
    """The non-increasing sequence closest to ``p`` in least squares (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, count]
    for x in p:
        blocks.append([x, 1])
        while len(blocks) > 1 and blocks[-2][0] < blocks[-1][0]:
            mean, count = blocks.pop()
            blocks[-1] = [(blocks[-1][0] * blocks[-1][1] + mean * count) / (blocks[-1][1] + count),
                          blocks[-1][1] + count]
    return [mean for mean, count in blocks for _ in range(count)]


def _scaled_clipped(p: list[float], low: int, high: int, target: int) -> list[float]:
    """``clip(lam * p, low, high)`` (units of q) with ``lam`` found by bisection so the sum is ``target``."""
    total = lambda lam: sum(min(high, max(low, lam * x)) for x in p)  # noqa: E731 - non-decreasing in lam
    lo_lam, hi_lam = 0.0, 1.0
    while total(hi_lam) < target:
        hi_lam *= 2
    for _ in range(200):
        mid = (lo_lam + hi_lam) / 2
        lo_lam, hi_lam = (mid, hi_lam) if total(mid) < target else (lo_lam, mid)
    return [min(high, max(low, hi_lam * x)) for x in p]


def _round_and_fill(u: list[float], target: int, low: int, high: int, order, what: str) -> list[int]:
    """Round ``u`` half up into [low, high] and move single units (any layer, within the bounds and the order)
    until the sum is ``target``: add where the deficit ``u - n`` is largest (ties: smallest l), remove where the
    excess ``n - u`` is largest (ties: largest l)."""
    n = [min(high, max(low, _round_half_up(x))) for x in u]
    last = len(n) - 1
    grows = lambda l: n[l] < high and (order is None or l == 0 or n[l - 1] > n[l])  # noqa: E731
    shrinks = lambda l: n[l] > low and (order is None or l == last or n[l] > n[l + 1])  # noqa: E731
    r = target - sum(n)
    while r:
        if r > 0:
            l = _pick([i for i in range(len(n)) if grows(i)], lambda i: u[i] - n[i], False)
        else:
            l = _pick([i for i in range(len(n)) if shrinks(i)], lambda i: n[i] - u[i], True)
        if l is None:
            raise ValueError(f"cannot round {what} to an exact total: use a smaller multiple_of")
        step = 1 if r > 0 else -1
        n[l] += step
        r -= step
    return n


def _explicit_widths(schedule, num_layers: int, base_width: int, q: int) -> list[int]:
    if not isinstance(schedule, (list, tuple)):
        raise ValueError(
            f"schedule={schedule!r} is not allowed; expected one of {', '.join(SCHEDULES)} "
            f"or an explicit list of per-layer widths"
        )
    widths = list(schedule)
    if len(widths) != num_layers:
        raise ValueError(
            f"schedule={widths!r} has {len(widths)} widths; expected num_layers={num_layers} entries"
        )
    for l, x in enumerate(widths):
        if not _is_int(x) or x < 1 or x % q:
            raise ValueError(
                f"schedule={widths!r}: entry {l} ({x!r}) is not allowed; every width must be an integer "
                f">= 1 and a multiple of multiple_of={q}"
            )
    if sum(widths) != num_layers * base_width:
        raise ValueError(
            f"schedule={widths!r} sums to {sum(widths)}; it must sum to num_layers*base_width = "
            f"{num_layers}*{base_width} = {num_layers * base_width} to keep the parameter budget"
        )
    return widths


# ----------------------------------------------------------------------------------------------
# invariants
# ----------------------------------------------------------------------------------------------


def _check_order(widths: list[int], order) -> bool:
    pairs = list(zip(widths, widths[1:]))
    if order == _NON_INCREASING:
        return all(x >= y for x, y in pairs)
    if order == _NON_DECREASING:
        return all(x <= y for x, y in pairs)
    return True


def _check_invariants(widths, exact, total, q, ends, order, what, check_error=False) -> None:
    """Explicit post-build checks (model.md 2.3); a failure is a bug here, hence RuntimeError."""
    problems = []
    if sum(widths) != total:
        problems.append(f"sum {sum(widths)} != {total}")
    if not _check_order(widths, order):
        problems.append(f"widths are not {order}")
    if (widths[0], widths[-1]) != tuple(ends):
        problems.append(f"endpoints {(widths[0], widths[-1])} != pinned {tuple(ends)}")
    if any(x % q or x < 1 for x in widths):
        problems.append(f"a width is < 1 or not a multiple of {q}")
    if check_error and any(abs(d - w) > q + 1e-9 * q for d, w in zip(widths, exact)):
        problems.append(f"a width is more than multiple_of={q} away from the exact schedule")
    if problems:
        raise RuntimeError(f"internal error building {what}: {'; '.join(problems)}; widths={widths}")
