"""[retention]: how long finished runs are kept, in batches of what size, how often a pass is tried."""

import pytest

from supervisor import config


def retention(text: str) -> config.RetentionSettings:
    return config.parse(f"[retention]\n{text}\n").retention


def test_on_by_default_at_thirty_days():
    assert config.Settings().retention == config.RetentionSettings(keep_finished=30 * 86400.0, batch_size=1000,
                                                                   interval=600.0)


@pytest.mark.parametrize(("value", "expected"), [
    ('"30d"', 30 * 86400.0), ('"12h"', 12 * 3600.0), ('"1h"', 3600.0), ("86400", 86400.0), ('"3600s"', 3600.0),
    ('"off"', None), ('"0"', None), ("0", None), ("0.0", None), ('" off "', None),
])
def test_keep_finished(value, expected):
    assert retention(f"keep_finished = {value}").keep_finished == expected


@pytest.mark.parametrize(("value", "message"), [
    ('"59m"', r"\[retention\] keep_finished: 3540s is less than 1h"),
    ("60", r"\[retention\] keep_finished: 60s is less than 1h"),
    ('"forever"', r"\[retention\] keep_finished: invalid duration 'forever'"),
    ('"no"', r"\[retention\] keep_finished: invalid duration 'no'"),
    ('"-1d"', r"\[retention\] keep_finished: invalid duration '-1d'"),
    ("-5", r"\[retention\] keep_finished: invalid duration -5: must be more than zero"),
    ("false", r"\[retention\] keep_finished: invalid duration False"),
    ("true", r"\[retention\] keep_finished: invalid duration True"),
    ('"nan"', r"\[retention\] keep_finished: invalid duration 'nan'"),
])
def test_bad_keep_finished_is_one_line_naming_the_key(value, message):
    with pytest.raises(config.ConfigError, match=message) as caught:
        retention(f"keep_finished = {value}")
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(("text", "message"), [
    ("batch_size = 0", r"\[retention\] batch_size: expected a whole number of at least 1"),
    ("batch_size = 10001", r"\[retention\] batch_size: 10001 is out of range \(1 to 10000\)"),
    ('batch_size = "1000"', r"\[retention\] batch_size: expected a whole number"),
    ('interval = "0s"', r"\[retention\] interval: invalid duration '0s': must be more than zero"),
    ('interval = "soon"', r"\[retention\] interval: invalid duration 'soon'"),
    ('keep = "30d"', r"\[retention\] keep: unknown key \(known: batch_size, interval, keep_finished\)"),
])
def test_bad_batch_size_interval_and_keys(text, message):
    with pytest.raises(config.ConfigError, match=message):
        retention(text)


def test_batch_size_and_interval():
    assert retention('batch_size = 10000\ninterval = "1h"') == config.RetentionSettings(batch_size=10000,
                                                                                      interval=3600.0)
