import pytest

from harness.units import format_bytes, parse_bytes, parse_seconds


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("16GiB", 16 * 2**30),
        ("80GB", 80 * 10**9),
        ("512 MiB", 512 * 2**20),
        ("1.5KiB", 1536),
        (1024, 1024),
        ("7", 7),
    ],
)
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["16 gigs", "GiB", "-1GiB", "0", 0, True, "1.2.3MiB"])
def test_parse_bytes_rejects(text):
    with pytest.raises(ValueError, match="size such as"):
        parse_bytes(text)


@pytest.mark.parametrize(
    ("text", "expected"), [("90s", 90), ("10m", 600), ("1h", 3600), (5, 5), ("2.5", 2.5)]
)
def test_parse_seconds(text, expected):
    assert parse_seconds(text) == expected


@pytest.mark.parametrize("text", ["soon", "-5s", 0, "10 days"])
def test_parse_seconds_rejects(text):
    with pytest.raises(ValueError, match="duration such as"):
        parse_seconds(text)


def test_format_bytes():
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.50 KiB"
    assert format_bytes(3 * 2**30) == "3.00 GiB"
    assert format_bytes(None) == "-"
    # short: three significant digits, never an exponent (1,010 KiB is below 1 MiB)
    assert format_bytes(1.5 * 2**20, short=True) == "1.5 MiB"
    assert format_bytes(123.4 * 2**30, short=True) == "123 GiB"
    assert format_bytes(1010 * 1024, short=True) == "1010 KiB"


def test_one_number_format_with_units_and_prefixes():
    from harness.units import format_quantity

    assert format_quantity(2602, "samples/s") == "2.60k samples/s"
    assert format_quantity(10540, "samples/s") == "10.5k samples/s"
    assert format_quantity(999.96) == "1.00k"  # rounding moves it to the next prefix
    assert format_quantity(12.345, "ms") == "12.3 ms"
    assert format_quantity(0.98712) == "0.987"
    assert format_quantity(123456789, "tokens/s") == "123M tokens/s"
    assert format_quantity(1.5e-5) == "1.50e-05"
    assert format_quantity(0) == "0" and format_quantity(float("nan")) == "-"
    assert format_quantity(None, "ms") == "-"
