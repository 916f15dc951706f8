"""Tests for tlm.schedule: invariants (model.md 2.3, 5.1), golden values, presets and error messages.

The module ships as standalone remote code, so it is loaded here from its file, without importing the
``tlm`` package (whose ``__init__`` pulls in torch and transformers): ``pytest --noconftest`` runs this
file without either.
"""

import ast
import importlib.util
import math
import pathlib
import re
import warnings

import pytest

SCHEDULE_FILE = pathlib.Path(__file__).resolve().parents[1] / "tlm" / "schedule.py"


def _load_standalone(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


sched = _load_standalone(SCHEDULE_FILE, "tlm_schedule_under_test")
SCHEDULES, parse_ratio, taper_widths = sched.SCHEDULES, sched.parse_ratio, sched.taper_widths
measured_widths = sched.measured_widths

CONTINUOUS = ("cosine", "linear", "sigmoid")
BASE_WIDTHS = (64, 128, 576, 1024, 1536)
MULTIPLES = (1, 16, 64)
START_RATIOS = (1.25, 1.5, 1.75)


def _logistic(t, k):
    return 1.0 / (1.0 + math.exp(-k * (t - 0.5)))


def _reference_profile(name, t, k=10.0):
    """The profiles exactly as written in model.md 2.1 (sigmoid in its logistic form)."""
    if name == "cosine":
        return (1.0 - math.cos(math.pi * t)) / 2.0
    if name == "linear":
        return t
    return (_logistic(t, k) - _logistic(0.0, k)) / (_logistic(1.0, k) - _logistic(0.0, k))


def _exact_widths(name, L, D, q, r_s, k=10.0):
    a = q * math.floor(r_s * D / q + 0.5)
    b = 2 * D - a
    if L == 1:
        return [float(D)]
    return [a - (a - b) * _reference_profile(name, l / (L - 1), k) for l in range(L)]


def _non_increasing(xs):
    return all(x >= y for x, y in zip(xs, xs[1:]))


def _non_decreasing(xs):
    return all(x <= y for x, y in zip(xs, xs[1:]))


# ------------------------------------------------------------------------------------------------
# invariants
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", CONTINUOUS)
def test_invariants_property_loop(name):
    checked = skipped = 0
    for D in BASE_WIDTHS:
        for q in (q for q in MULTIPLES if D % q == 0):
            for r_s in START_RATIOS:
                a = q * math.floor(r_s * D / q + 0.5)
                if 2 * D - a < 1:  # e.g. D = q = 64, r_s = 1.5: the last layer would get width 0
                    with pytest.raises(ValueError, match=r"gives a last-layer width of 0"):
                        taper_widths(2, D, name, (r_s, 2 - r_s), multiple_of=q)
                    skipped += 1
                    continue
                for L in range(1, 49):
                    widths = taper_widths(L, D, name, (r_s, 2 - r_s), multiple_of=q)
                    exact = _exact_widths(name, L, D, q, r_s)
                    ctx = (name, L, D, q, r_s, widths)
                    assert len(widths) == L, ctx
                    assert all(isinstance(x, int) for x in widths), ctx
                    assert sum(widths) == L * D, ctx
                    assert _non_increasing(widths), ctx
                    assert all(x % q == 0 and x >= 1 for x in widths), ctx
                    assert all(abs(d - w) <= q + 1e-6 for d, w in zip(widths, exact)), ctx
                    if L == 1:
                        assert widths == [D], ctx
                    else:
                        assert (widths[0], widths[-1]) == (a, 2 * D - a), ctx
                    checked += 1
    assert skipped == 3  # D = q = 64 with r_s = 1.5, 1.75 and D = 128, q = 64 with r_s = 1.75
    assert checked == 48 * (len(START_RATIOS) * 15 - skipped)  # every D here admits all of q = 1, 16, 64


@pytest.mark.parametrize("name", CONTINUOUS)
@pytest.mark.parametrize("L", [3, 4, 7])
def test_odd_base_width_with_q1(name, L):
    widths = taper_widths(L, 37, name, multiple_of=1)
    assert sum(widths) == L * 37
    assert _non_increasing(widths)
    assert widths[0] == 56 and widths[-1] == 18  # round_half_up(55.5) = 56, 74 - 56 = 18
    assert all(abs(d - w) <= 1 for d, w in zip(widths, _exact_widths(name, L, 37, 1, 1.5)))


@pytest.mark.parametrize("name", CONTINUOUS)
def test_small_depths(name):
    assert taper_widths(1, 1024, name) == [1024]
    assert taper_widths(2, 1024, name) == [1536, 512]
    assert taper_widths(2, 37, name, "1.25/0.75", multiple_of=1) == [46, 28]  # 46.25 -> 46


def test_result_is_a_fresh_list_of_python_ints():
    a = taper_widths(6, 1024)
    b = taper_widths(6, 1024)
    assert a == b and a is not b
    assert all(type(x) is int for x in a)


# ------------------------------------------------------------------------------------------------
# golden values (model.md 2.3)
# ------------------------------------------------------------------------------------------------


def test_tie_example_linear():
    assert taper_widths(5, 1152, "linear", (1.5, 0.5), multiple_of=64) == [1728, 1472, 1152, 832, 576]


def test_cosine_cpu_config():
    assert taper_widths(6, 1024) == [1536, 1440, 1184, 864, 608, 512]
    assert taper_widths(6, 1024, "cosine", "1.5/0.5", 16) == [1536, 1440, 1184, 864, 608, 512]


def test_cosine_unit_test_config():
    assert taper_widths(4, 128) == [192, 160, 96, 64]


def test_cosine_l24_row():
    widths = taper_widths(24, 4096)
    assert widths[:4] == [6144, 6128, 6064, 5968]
    assert widths[-4:] == [2224, 2128, 2064, 2048]
    assert sum(widths) == 24 * 4096


# ------------------------------------------------------------------------------------------------
# profiles
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [0.01, 1.0, 10.0, 30.0, 200.0])
def test_sigmoid_profile_point_symmetric_and_pinned(k):
    assert sched._sigmoid_profile(0.0, k) == pytest.approx(0.0, abs=1e-15)
    assert sched._sigmoid_profile(1.0, k) == pytest.approx(1.0, abs=1e-15)
    assert sched._sigmoid_profile(0.5, k) == pytest.approx(0.5, abs=1e-15)
    ts = [i / 100 for i in range(101)]
    values = [sched._sigmoid_profile(t, k) for t in ts]
    assert _non_decreasing(values)
    for t, p in zip(ts, values):
        assert sched._sigmoid_profile(1.0 - t, k) == pytest.approx(1.0 - p, abs=1e-12)


@pytest.mark.parametrize("k", [1.0, 10.0, 30.0])
def test_sigmoid_profile_matches_logistic_form(k):
    for i in range(11):
        t = i / 10
        assert sched._sigmoid_profile(t, k) == pytest.approx(_reference_profile("sigmoid", t, k), abs=1e-12)


def test_sigmoid_limits():
    ts = [i / 20 for i in range(21)]
    assert all(sched._sigmoid_profile(t, 1e-6) == pytest.approx(t, abs=1e-9) for t in ts)
    steep = [sched._sigmoid_profile(t, 1000.0) for t in ts]
    assert all(p < 1e-9 for p in steep[:10]) and all(p > 1 - 1e-9 for p in steep[11:])


@pytest.mark.parametrize("name", ["cosine", "linear"])
def test_other_profiles_point_symmetric(name):
    for i in range(101):
        t = i / 100
        p = sched._profile(name, t)
        assert sched._profile(name, 1.0 - t) == pytest.approx(1.0 - p, abs=1e-12)
    assert sched._profile(name, 0.0) == 0.0 and sched._profile(name, 1.0) == 1.0


def test_steepness_changes_sigmoid_shape():
    gentle = taper_widths(12, 1024, "sigmoid", steepness=2.0)
    steep = taper_widths(12, 1024, "sigmoid", steepness=30.0)
    assert gentle != steep
    assert steep[1] > gentle[1] and steep[-2] < gentle[-2]  # a steeper step keeps the ends flatter
    assert sum(gentle) == sum(steep) == 12 * 1024


# ------------------------------------------------------------------------------------------------
# uniform, explicit, three-group, reverse
# ------------------------------------------------------------------------------------------------


def test_uniform_ignores_ratio():
    assert taper_widths(5, 1024, "uniform") == [1024] * 5
    assert taper_widths(3, 37, "uniform", ratio=(1.9, 0.9), multiple_of=1) == [37] * 3


def test_schedule_names():
    assert SCHEDULES == ("cosine", "linear", "sigmoid", "uniform", "three-group", "x-shape", "middle-heavy")
    assert taper_widths(6, 1024, "Cosine") == taper_widths(6, 1024, "cosine")
    assert taper_widths(6, 64, "three_group", "1.5/1/0.5") == taper_widths(6, 64, "three-group", "1.5/1/0.5")


def test_explicit_list_valid():
    given = [96, 80, 48, 32]
    out = taper_widths(4, 64, given)
    assert out == given and out is not given
    assert taper_widths(4, 64, tuple(given)) == given
    assert taper_widths(3, 37, [40, 37, 34], multiple_of=1) == [40, 37, 34]


@pytest.mark.parametrize(
    "widths, match",
    [
        ([96, 80, 48], r"has 3 widths; expected num_layers=4"),
        ([96, 80, 48, 32, 0], r"has 5 widths; expected num_layers=4"),
        ([96, 80, 80, 0], r"entry 3 \(0\) is not allowed.*>= 1 and a multiple of multiple_of=16"),
        ([96, 88, 40, 32], r"entry 1 \(88\) is not allowed.*multiple of multiple_of=16"),
        ([96, 80, 48.0, 32], r"entry 2 \(48\.0\) is not allowed.*integer"),
        ([96, 80, 64, 32], r"sums to 272; it must sum to num_layers\*base_width = 4\*64 = 256"),
    ],
)
def test_explicit_list_invalid(widths, match):
    with pytest.raises(ValueError, match=match):
        taper_widths(4, 64, widths)


def test_explicit_list_wrong_type():
    with pytest.raises(ValueError, match=r"schedule=\{96, 32\} is not allowed; expected one of cosine"):
        taper_widths(2, 64, {96, 32})


@pytest.mark.parametrize("L", range(1, 49))
def test_three_group_wider_early_any_depth(L):
    widths = taper_widths(L, 1024, "three-group", (1.5, 1, 0.5))
    n_f = L // 3
    assert sum(widths) == L * 1024
    assert widths == [1536] * n_f + [1024] * (L - 2 * n_f) + [512] * n_f
    assert _non_increasing(widths)


@pytest.mark.parametrize("L", [3, 6, 24, 48])
def test_three_group_wider_middle_when_three_divides(L):
    widths = taper_widths(L, 1024, "three-group", "0.75/1.5/0.75")
    n = L // 3
    assert widths == [768] * n + [1536] * n + [768] * n
    assert sum(widths) == L * 1024


@pytest.mark.parametrize("L, groups", [(32, "10/12/10"), (7, "2/3/2"), (25, "8/9/8")])
def test_three_group_wider_middle_rejected_otherwise(L, groups):
    match = rf"ratio=\(0\.75, 1\.5, 0\.75\) with num_layers={L} \(groups {groups}\).*must equal num_layers={L}"
    with pytest.raises(ValueError, match=match):
        taper_widths(L, 1024, "three-group", (0.75, 1.5, 0.75))


def test_three_group_rejection_suggests_solved_multiplier():
    with pytest.raises(ValueError, match=r"keep m_m=1\.5 and use m_f = m_b = 0\.7\b"):
        taper_widths(32, 1024, "three-group", (0.75, 1.5, 0.75))
    assert sum(taper_widths(32, 1000, "three-group", (0.7, 1.5, 0.7), multiple_of=1)) == 32 * 1000


def test_three_group_wider_late_and_short_stacks():
    widths = taper_widths(24, 1024, "three-group", "0.5/1/1.5")
    assert widths == [512] * 8 + [1024] * 8 + [1536] * 8
    assert taper_widths(1, 64, "three-group", (1.5, 1, 0.5)) == [64]
    assert taper_widths(2, 64, "three-group", (1.5, 1, 0.5)) == [64, 64]


def test_three_group_rounding_repair_keeps_sum_and_ends():
    # 0.75 * 1152 = 864 = 13.5 units of 64 rounds up to 14: two units over, taken from the interior layers
    # with the largest excess n - u (layers 1 and 4, 0.5 each; ties go to the largest l first).
    widths = taper_widths(6, 1152, "three-group", (0.75, 1.5, 0.75), multiple_of=64)
    assert widths == [896, 832, 1728, 1728, 832, 896]
    assert sum(widths) == 6 * 1152


@pytest.mark.parametrize(
    "ratio, match",
    [
        ((1.5, 0.5), r"ratio=\(1\.5, 0\.5\) has 2 values; the three-group schedule takes three"),
        ((1.5, 1.0, 0.5, 1.0), r"has 4 values; the three-group schedule takes three"),
        ((2.5, 1.0, -0.5), r"multipliers must all be > 0"),
        ((1.5, 1.0, 0.75), r"must equal num_layers=6"),
    ],
)
def test_three_group_invalid(ratio, match):
    with pytest.raises(ValueError, match=match):
        taper_widths(6, 1024, "three-group", ratio)


@pytest.mark.parametrize("name", CONTINUOUS)
def test_reverse_taper_warns_and_is_non_decreasing(name):
    for L in (2, 5, 12, 24):
        with pytest.warns(UserWarning, match=r"reverse taper.*paper reports that it hurts"):
            widths = taper_widths(L, 1024, name, (0.5, 1.5))
        assert _non_decreasing(widths)
        assert sum(widths) == L * 1024
        assert (widths[0], widths[-1]) == (512, 1536)


def test_reverse_taper_property_loop():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        for name in CONTINUOUS:
            for D, q in ((64, 16), (576, 64), (1152, 64), (37, 1)):
                for r_s in (0.25, 0.5, 0.75):
                    for L in range(1, 33):
                        widths = taper_widths(L, D, name, (r_s, 2 - r_s), multiple_of=q)
                        exact = _exact_widths(name, L, D, q, r_s)
                        assert sum(widths) == L * D
                        assert _non_decreasing(widths)
                        assert all(x % q == 0 for x in widths)
                        assert all(abs(d - w) <= q + 1e-6 for d, w in zip(widths, exact))


def test_normal_taper_does_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        taper_widths(6, 1024)
        taper_widths(6, 1024, "linear", (1.0, 1.0))


def test_flat_ratio_is_uniform():
    assert taper_widths(7, 1024, "cosine", (1.0, 1.0)) == [1024] * 7


# ------------------------------------------------------------------------------------------------
# ratio parsing
# ------------------------------------------------------------------------------------------------


def test_parse_ratio():
    assert parse_ratio("1.5/0.5") == (1.5, 0.5)
    assert parse_ratio(" 1.25 / 0.75 ") == (1.25, 0.75)
    assert parse_ratio("1.5/1/0.5") == (1.5, 1.0, 0.5)
    assert parse_ratio((1.5, 0.5)) == (1.5, 0.5)
    assert parse_ratio([2, 0]) == (2.0, 0.0)
    assert all(type(x) is float for x in parse_ratio([2, 1]))


@pytest.mark.parametrize("text", ["1.5", "1.5-0.5", "a/b", "1.5/", "/0.5", "", "1.5//0.5", "nan/1", "inf/0.5"])
def test_parse_ratio_malformed(text):
    with pytest.raises(ValueError, match=r"is malformed; expected the form 'A/B'"):
        parse_ratio(text)


@pytest.mark.parametrize(
    "value, match",
    [
        ((1.5,), r"needs at least two values"),
        (("1.5", 0.5), r"'1\.5' is not a finite number"),
        ((True, 1.0), r"True is not a finite number"),
        ((float("nan"), 1.0), r"nan is not a finite number"),
        (1.5, r"ratio=1\.5 is not a ratio; expected a string of the form 'A/B'"),
    ],
)
def test_parse_ratio_bad_sequences(value, match):
    with pytest.raises(ValueError, match=match):
        parse_ratio(value)


def test_malformed_ratio_string_through_taper_widths():
    with pytest.raises(ValueError, match=r"ratio='1\.5:0\.5' is malformed; expected the form 'A/B'"):
        taper_widths(6, 1024, "cosine", "1.5:0.5")


# ------------------------------------------------------------------------------------------------
# error messages
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(ratio=(2.0, 0.5)),
         r"^ratio=\(2\.0, 0\.5\): start and end must sum to 2 to keep the parameter budget \(e\.g\. 1\.5/0\.5\)$"),
        (dict(ratio="1.2/0.7"), r"ratio=\(1\.2, 0\.7\): start and end must sum to 2"),
        (dict(ratio=(2.5, -0.5)), r"ratio=\(2\.5, -0\.5\): start and end must both be > 0"),
        (dict(ratio=(2.0, 0.0)), r"ratio=\(2\.0, 0\.0\): start and end must both be > 0"),
        (dict(ratio=(1.5, 1.0, 0.5)), r"ratio=\(1\.5, 1\.0, 0\.5\) has 3 values; the continuous schedules take two"),
        (dict(schedule="tapered"), r"schedule='tapered' is unknown; expected one of cosine, linear, sigmoid, uniform, three-group"),
        (dict(schedule="sigmoid", steepness=0.0), r"steepness=0\.0 is not allowed for the sigmoid schedule; expected a finite number > 0"),
        (dict(schedule="sigmoid", steepness=-3), r"steepness=-3 is not allowed"),
        (dict(schedule="sigmoid", steepness=float("inf")), r"steepness=inf is not allowed"),
    ],
)
def test_invalid_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        taper_widths(6, 1024, **kwargs)


def test_multiple_of_must_divide_base_width():
    with pytest.raises(
        ValueError,
        match=r"^multiple_of=16 does not divide base_width=37; use multiple_of=1 or a base width that is a multiple of 16$",
    ):
        taper_widths(4, 37)
    with pytest.raises(ValueError, match=r"multiple_of=16 does not divide base_width=37"):
        taper_widths(4, 37, "uniform")


def test_width_below_one_after_rounding():
    with pytest.raises(
        ValueError,
        match=r"^ratio=\(1\.99, 0\.01\) with base_width=64, multiple_of=16 gives a last-layer width of 0; ",
    ):
        taper_widths(4, 64, "cosine", (1.99, 0.01))
    with pytest.warns(UserWarning, match="reverse taper"):
        with pytest.raises(ValueError, match=r"gives a first-layer width of 0"):
            taper_widths(4, 64, "linear", (0.01, 1.99))
    with pytest.raises(ValueError, match=r"gives a back-group width of 0"):
        taper_widths(3, 64, "three-group", (1.99, 1.0, 0.01))


@pytest.mark.parametrize(
    "name, value, low",
    [("num_layers", 0, 1), ("num_layers", -2, 1), ("num_layers", 2.0, 1), ("num_layers", True, 1),
     ("base_width", 0, 1), ("base_width", "64", 1), ("multiple_of", 0, 1), ("multiple_of", -16, 1)],
)
def test_integer_arguments(name, value, low):
    kwargs = dict(num_layers=4, base_width=64, multiple_of=16)
    kwargs[name] = value
    with pytest.raises(ValueError, match=rf"^{name}={re.escape(repr(value))} is not allowed; expected an integer >= {low}$"):
        taper_widths(**kwargs)


def test_repair_failure_is_a_value_error():
    # No interior layer to take the surplus: the message names the schedule and its inputs.
    with pytest.raises(ValueError, match=r"cannot round the cosine schedule \(num_layers=3, base_width=64, multiple_of=16"):
        sched._repair([4, 4, 4], [4.0, 4.0, 4.0], 13, "non-increasing",
                      "the cosine schedule (num_layers=3, base_width=64, multiple_of=16, ratio=(1.0, 1.0))")


def test_invariant_violation_is_a_runtime_error():
    with pytest.raises(RuntimeError, match=r"sum 130 != 128"):
        sched._check_invariants([66, 64], [64.0, 64.0], 128, 1, (66, 64), "non-increasing", "a test")
    with pytest.raises(RuntimeError, match=r"not non-increasing"):
        sched._check_invariants([32, 96], [64.0, 64.0], 128, 16, (32, 96), "non-increasing", "a test")


# ------------------------------------------------------------------------------------------------
# remote-code constraint
# ------------------------------------------------------------------------------------------------


# ------------------------------------------------------------------------------------------------
# grouped shapes: x-shape (wide first and last thirds) and middle-heavy (wide middle ~70%)
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["x-shape", "middle-heavy"])
@pytest.mark.parametrize("L", range(1, 37))
@pytest.mark.parametrize("D, q", [(64, 1), (64, 16), (1536, 64), (37, 1)])
def test_grouped_shapes_keep_the_budget_exactly(name, L, D, q):
    widths = taper_widths(L, D, name, "1.5/0.5", multiple_of=q)
    assert len(widths) == L and sum(widths) == L * D
    assert all(w >= q and w % q == 0 for w in widths)


def test_x_shape_is_wide_in_the_first_and_last_thirds():
    widths = taper_widths(30, 1536, "x-shape", "1.5/0.5", multiple_of=64)
    assert widths == [1984] * 10 + [640] * 10 + [1984] * 10  # 3:1 scaled to the budget, rounded to 64
    assert taper_widths(7, 75, "x-shape", "1.5/0.5", multiple_of=1) == [105, 105, 35, 35, 35, 105, 105]  # 2/3/2


def test_middle_heavy_widens_the_middle_seventy_percent():
    widths = taper_widths(20, 1024, "middle-heavy", "1.5/0.5", multiple_of=16)
    wide = [l for l, w in enumerate(widths) if w > 1024]
    assert wide == list(range(3, 17))  # round(0.7 * 20) = 14 layers, 3 narrow in front and 3 behind
    assert sum(widths) == 20 * 1024 and max(widths) > 2.5 * min(widths)
    assert [l for l, w in enumerate(taper_widths(10, 64, "middle-heavy", "1.5/0.5", 1)) if w > 64] == list(range(1, 8))


def test_grouped_ratio_is_the_wide_to_narrow_proportion():
    mild = taper_widths(6, 600, "x-shape", "1.2/0.8", multiple_of=1)
    assert mild == [675, 675, 450, 450, 675, 675]  # 1.2 : 0.8, scaled so the sum is 6 * 600
    assert taper_widths(6, 600, "x-shape", "3/1", multiple_of=1) == taper_widths(6, 600, "x-shape", "1.5/0.5", 1)


@pytest.mark.parametrize("ratio, match", [("1.5/1/0.5", "expected two numbers > 0"), ("1.5/0", "two numbers > 0")])
def test_grouped_bad_ratio(ratio, match):
    with pytest.raises(ValueError, match=match):
        taper_widths(6, 64, "x-shape", ratio)


# ------------------------------------------------------------------------------------------------
# measured widths from a per-layer profile
# ------------------------------------------------------------------------------------------------


def test_measured_widths_follow_the_profile_within_bounds_at_the_exact_budget():
    profile = [5, 1, 3, 0, 2, 4]
    widths = measured_widths(profile, 64, multiple_of=16)
    assert sum(widths) == 6 * 64 and all(w % 16 == 0 for w in widths)
    assert all(32 <= w <= 96 for w in widths)  # 0.5x .. 1.5x
    order = sorted(range(6), key=lambda l: -profile[l])
    assert [widths[l] for l in order] == sorted(widths, reverse=True)  # larger score, never narrower
    assert widths[3] == 32 and widths[0] == 96  # the zero layer at the floor, the top layer at the ceiling


def test_measured_widths_proportional_when_no_bound_binds():
    assert measured_widths([3, 2, 1], 200, multiple_of=1) == [300, 200, 100]
    assert measured_widths([3, 2, 1], 200, multiple_of=1, bounds=(0.6, 1.4)) == [280, 200, 120]  # clipped, refilled
    assert measured_widths([1, 1, 1, 1], 64, multiple_of=16) == [64] * 4
    assert measured_widths([7.0, 7.0], 64) == measured_widths([1, 1], 64)  # scale-free


@pytest.mark.parametrize("seed", range(20))
def test_measured_widths_monotone_is_a_taper(seed):
    import random

    rng = random.Random(seed)
    L = rng.randint(2, 30)
    profile = [rng.random() for _ in range(L)]
    widths = measured_widths(profile, 1024, multiple_of=64, monotone=True)
    assert sum(widths) == L * 1024 and _non_increasing(widths)
    assert all(512 <= w <= 1536 for w in widths)
    free = measured_widths(profile, 1024, multiple_of=64)
    assert sum(free) == L * 1024 and all(512 <= w <= 1536 for w in free)
    assert measured_widths(profile, 1024, multiple_of=64, monotone=True) == widths  # deterministic


def test_measured_monotone_pools_violators():
    # the closest non-increasing profile of [1, 3, 2] is [2, 2, 2]: uniform; of [4, 1, 3, 0] it is [4, 2, 2, 0]
    assert measured_widths([1, 3, 2], 64, multiple_of=1, monotone=True) == [64, 64, 64]
    assert measured_widths([4, 1, 3, 0], 100, multiple_of=1, bounds=(0.25, 2), monotone=True) == [187, 94, 94, 25]


@pytest.mark.parametrize("kwargs, match", [
    (dict(profile=[]), "non-empty list"),
    (dict(profile=[1, -1]), r"entry 1 \(-1\)"),
    (dict(profile=[0, 0]), "all zeros"),
    (dict(profile=[1, float("nan")]), "entry 1"),
    (dict(profile=[1, 0, 0, 0]), "cannot fill"),  # one layer at 1.5x cannot hold 4 layers' budget
    (dict(profile=[1, 2], bounds=(1.2, 1.5)), r"0 < lo <= 1 <= hi"),
    (dict(profile=[1, 2], base_width=60), "multiple_of=16 does not divide base_width=60"),
])
def test_measured_widths_errors(kwargs, match):
    args = {"base_width": 64, "multiple_of": 16, **kwargs}
    with pytest.raises(ValueError, match=match):
        measured_widths(args.pop("profile"), **args)


def test_module_imports_only_the_standard_library():
    tree = ast.parse(SCHEDULE_FILE.read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "no relative imports in remote code"
            imported.add(node.module.split(".")[0])
    assert imported <= {"logging", "math", "warnings", "typing", "collections"}, imported
    assert not any(isinstance(node, ast.Assert) for node in ast.walk(tree))


def test_module_loads_standalone_as_remote_code(tmp_path):
    # transformers copies the file next to the checkpoint and imports it outside the tlm package.
    copy = tmp_path / "schedule.py"
    copy.write_text(SCHEDULE_FILE.read_text())
    module = _load_standalone(copy, "tlm_remote_schedule")
    assert module.taper_widths(6, 1024) == [1536, 1440, 1184, 864, 608, 512]
