"""supervisor.quantities: human sizes, durations and percentages to numbers, and back for display."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta, timezone

import pytest

from supervisor.quantities import (
    QuantityError,
    format_duration,
    format_size,
    parse_duration,
    parse_percent,
    parse_size,
    parse_time,
)

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40


# -- sizes ------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("text", "expected"), [
    ("512M", 512 * MiB),
    ("2G", 2 * GiB),
    ("1T", TiB),
    ("4K", 4 * KiB),
    ("1", 1),
    ("1048576", MiB),
    (" 2G ", 2 * GiB),
    ("\t2 G\n", 2 * GiB),
    ("512m", 512 * MiB),
    ("2g", 2 * GiB),
    ("1t", TiB),
    ("4k", 4 * KiB),
    ("512MB", 512 * MiB),
    ("512MiB", 512 * MiB),
    ("2gib", 2 * GiB),
    ("100B", 100),
    (4096, 4096),
    (1, 1),
])
def test_parse_size_accepts(text, expected):
    assert parse_size(text) == expected


def test_parse_size_multiples_are_binary_not_decimal():
    assert parse_size("1K") == 1024
    assert parse_size("1M") == 1024 * 1024
    assert parse_size("1G") != 1_000_000_000


@pytest.mark.parametrize("text", [
    "12XB", "12X", "1P", "1E", "", "   ", "M", "G2", "1.5G", "1,5G", "-1", "-1G", "+1G", "1 G B x",
    "0x10", "abc", "2GG", "1e3",
])
def test_parse_size_rejects_malformed(text):
    with pytest.raises(QuantityError, match="invalid size"):
        parse_size(text)


def test_parse_size_error_names_value_and_accepted_forms():
    with pytest.raises(QuantityError) as info:
        parse_size("12XB")
    assert str(info.value) == "invalid size '12XB': use a whole number with K, M, G or T, like 512M or 2G"


@pytest.mark.parametrize("text", ["0", "0M", " 0G ", 0, -1, -5 * GiB])
def test_parse_size_rejects_zero_and_negative(text):
    with pytest.raises(QuantityError, match="must be more than zero"):
        parse_size(text)


@pytest.mark.parametrize("value", [True, False, 1.5, None])
def test_parse_size_rejects_non_integers(value):
    with pytest.raises(QuantityError, match="invalid size"):
        parse_size(value)


def test_quantity_error_is_a_value_error():
    assert issubclass(QuantityError, ValueError)


# -- durations --------------------------------------------------------------------------------------

@pytest.mark.parametrize(("text", "expected"), [
    ("90s", 90.0),
    ("10m", 600.0),
    ("2h", 7200.0),
    ("1d", 86400.0),
    ("90", 90.0),
    ("1", 1.0),
    ("1.5m", 90.0),
    ("0.5s", 0.5),
    ("0.25", 0.25),
    (" 10 m ", 600.0),
    ("\t2h\n", 7200.0),
    (90, 90.0),
    (2.5, 2.5),
])
def test_parse_duration_accepts(text, expected):
    value = parse_duration(text)
    assert value == expected
    assert isinstance(value, float)


@pytest.mark.parametrize("text", [
    "", "s", "10x", "10ms", "10 min", "10M", "2H", "1D", "10S", "1w", "1y", "-5s", "-5", "+5s", ".5s", "5.s",
    "1e3", "1h30m", "abc", "5 5s", "nan", "inf",
])
def test_parse_duration_rejects_malformed(text):
    with pytest.raises(QuantityError, match="invalid duration"):
        parse_duration(text)


def test_parse_duration_error_message():
    with pytest.raises(QuantityError) as info:
        parse_duration("10x")
    assert str(info.value) == "invalid duration '10x': use a number with s, m, h or d, like 90s or 10m"


@pytest.mark.parametrize("value", ["0", "0s", "0.0m", 0, 0.0, -1, -0.5])
def test_parse_duration_rejects_zero_and_negative(value):
    with pytest.raises(QuantityError, match="must be more than zero"):
        parse_duration(value)


@pytest.mark.parametrize("value", [True, False, None])
def test_parse_duration_rejects_non_numbers(value):
    with pytest.raises(QuantityError, match="invalid duration"):
        parse_duration(value)


def test_parse_duration_rejects_nan():
    with pytest.raises(QuantityError):
        parse_duration(math.nan)


def test_parse_duration_rejects_infinity():
    with pytest.raises(QuantityError):
        parse_duration(math.inf)


def test_parse_duration_rejects_digit_string_that_overflows_to_infinity():
    with pytest.raises(QuantityError):
        parse_duration("1" + "0" * 400 + "s")


# -- percentages ------------------------------------------------------------------------------------

@pytest.mark.parametrize(("text", "expected"), [
    ("50%", 50),
    ("200%", 200),
    ("100%", 100),
    ("1%", 1),
    ("50", 50),
    (" 50 % ", 50),
    (50, 50),
    (250, 250),
])
def test_parse_percent_accepts(text, expected):
    assert parse_percent(text) == expected


@pytest.mark.parametrize("text", ["0%", "0", 0, "000%"])
def test_parse_percent_rejects_zero(text):
    with pytest.raises(QuantityError, match=r"must be more than 0%"):
        parse_percent(text)


@pytest.mark.parametrize("text", ["abc", "", "%", "50%%", "-5%", "-5", "50.5%", "1.5", "50 percent", "%50",
                                  True, False, 1.5, None])
def test_parse_percent_rejects_malformed(text):
    with pytest.raises(QuantityError, match="invalid percentage"):
        parse_percent(text)


def test_parse_percent_error_message():
    with pytest.raises(QuantityError) as info:
        parse_percent("abc")
    assert str(info.value) == "invalid percentage 'abc': use a whole number like 50% or 200%"


# -- formatting -------------------------------------------------------------------------------------

@pytest.mark.parametrize(("value", "expected"), [
    (None, "-"),
    (512 * MiB, "512M"),
    (2 * GiB, "2G"),
    (TiB, "1T"),
    (3 * TiB, "3T"),
    (KiB, "1K"),
    (1536 * MiB, "1536M"),
    (1536, "1536"),
    (1000, "1000"),
    (1, "1"),
    (1025 * KiB, "1025K"),
])
def test_format_size(value, expected):
    assert format_size(value) == expected


@pytest.mark.parametrize("text", ["1", "1000", "4K", "512M", "1536M", "2G", "1T", "7T"])
def test_format_size_round_trips_through_parse_size(text):
    assert format_size(parse_size(text)) == text


@pytest.mark.parametrize(("seconds", "expected"), [
    (None, "-"),
    (0, "0s"),
    (0.0, "0s"),
    (5, "5s"),
    (5.0, "5s"),
    (5.5, "5.5s"),
    (0.3, "0.3s"),
    (10, "10s"),
    (42.4, "42s"),
    (59, "59s"),
    (60, "1m00s"),
    (90, "1m30s"),
    (605, "10m05s"),
    (3599, "59m59s"),
    (3600, "1h00m"),
    (3661, "1h01m"),
    (7200, "2h00m"),
    (86399, "23h59m"),
    (86400, "1d00h"),
    (90000, "1d01h"),
    (10 * 86400 + 5 * 3600, "10d05h"),
    (-5, "0s"),
    (-0.1, "0s"),
])
def test_format_duration(seconds, expected):
    assert format_duration(seconds) == expected


# -- times ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "expected"), [
    ("2026-12-01T03:00:00Z", datetime(2026, 12, 1, 3, tzinfo=UTC)),
    ("2026-12-01 03:00:00+00:00", datetime(2026, 12, 1, 3, tzinfo=UTC)),
    (" 2026-12-01T04:30+01:30 ", datetime(2026, 12, 1, 3, tzinfo=UTC)),
    ("2026-12-01T03:00:00.250Z", datetime(2026, 12, 1, 3, 0, 0, 250000, tzinfo=UTC)),
])
def test_parse_time_reads_iso_8601_with_an_offset(text, expected):
    value = parse_time(text)
    assert value == expected and value.tzinfo is not None


def test_parse_time_takes_a_time_without_an_offset_as_local_time():
    assert parse_time("2026-12-01T03:00") == datetime(2026, 12, 1, 3).astimezone()
    assert parse_time("2026-12-01") == datetime(2026, 12, 1).astimezone()


@pytest.mark.parametrize(("text", "seconds"), [("+10m", 600), ("+90s", 90), ("+2h", 7200), ("+1.5d", 129600),
                                               ("+30", 30), (" +5m", 300)])
def test_parse_time_reads_a_duration_from_now(text, seconds):
    assert parse_time(text) == timedelta(seconds=seconds)


@pytest.mark.parametrize("text", ["+", "+0s", "+-5m", "+10 minutes", "+inf", "+nan"])
def test_parse_time_rejects_a_bad_duration(text):
    with pytest.raises(QuantityError, match=r"after '\+' comes a duration"):
        parse_time(text)


@pytest.mark.parametrize("text", ["", "tomorrow", "now", "infinity", "2026-13-01", "2026-12-01T25:00",
                                  "10m", "-10m", "12/01/2026", "0001-01-01T00:00+14:00"])
def test_parse_time_rejects_what_is_not_a_time(text):
    with pytest.raises(QuantityError, match="use ISO 8601"):
        parse_time(text)


def test_parse_time_keeps_the_instant_of_another_offset():
    value = parse_time("2026-12-01T03:00:00-05:00")
    assert value == datetime(2026, 12, 1, 3, tzinfo=timezone(timedelta(hours=-5)))
