"""Acceptance tests for `IOConfig`, `parse_size` and `format_size` (docs/internals.md, io_engine).

Written against the contract, not the implementation: every expectation below is either stated in the
contract or follows from it (for example "ValueError names the field").
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from io_engine import IOConfig, format_size, parse_size

FIELDS = {"block_size", "threads", "queue_depth", "direct", "alignment", "submit"}

# ---------------------------------------------------------------------------------------------- parse_size


@pytest.mark.parametrize(
    "text, expected",
    [
        (0, 0),
        (4096, 4096),
        ("0", 0),
        ("123", 123),
        ("4k", 4096),
        ("4KiB", 4096),
        ("1MB", 10**6),
        ("1GB", 10**9),
        ("2kB", 2000),  # decimal, like "1MB" in the contract
        ("1TB", 10**12),
        ("1MiB", 2**20),
        ("1.5GiB", 3 * 2**29),
        ("8GiB", 8 * 2**30),
        ("2TiB", 2 * 2**40),
        ("0.5KiB", 512),
        ("4.1GB", 4_100_000_000),  # 4.1 * 1e9 is 4099999999.9999995 in floats: refused as fractional bytes
        ("8.2GB", 8_200_000_000),
        ("16.4GB", 16_400_000_000),
        ("0.3MB", 300_000),
    ],
)
def test_parse_size_accepts_contract_forms(text, expected):
    value = parse_size(text)
    assert value == expected
    assert isinstance(value, int) and not isinstance(value, bool)


@pytest.mark.parametrize(
    "text",
    ["abc", "KiB", "4XiB", "1.2.3MiB", "-1", "-4KiB", "4 parsecs", "infGiB", "nanMiB", "1MiB1"],
)
def test_parse_size_rejects_bad_strings_naming_them(text):
    with pytest.raises(ValueError) as info:
        parse_size(text)
    assert text in str(info.value), f"the message should quote the bad string {text!r}: {info.value}"


DECIMAL_UNITS = {"kB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
                 "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(st.integers(min_value=0, max_value=10**5), st.integers(min_value=0, max_value=99), st.sampled_from([1, 2]),
       st.sampled_from(sorted(DECIMAL_UNITS)))  # fmt: skip
def test_parse_size_reads_one_and_two_decimals_exactly(whole, frac, places, unit):
    # The bytes are (whole * 10**places + frac) * unit / 10**places: a whole count exactly when that divides.
    frac %= 10**places
    text = f"{whole}.{frac:0{places}d}{unit}"
    scaled = (whole * 10**places + frac) * DECIMAL_UNITS[unit]
    if scaled % 10**places == 0:
        assert parse_size(text) == scaled // 10**places, text
    else:
        with pytest.raises(ValueError, match="not a whole number of bytes"):
            parse_size(text)


@pytest.mark.parametrize("text", ["0.1GiB", "0.3KiB", "1.5", "0.0001kB"])
def test_parse_size_refuses_fractional_bytes(text):
    with pytest.raises(ValueError, match="not a whole number of bytes"):
        parse_size(text)


HUGE = "1" + "0" * 310  # past float's range: the float product was inf, and int(inf) an OverflowError


@pytest.mark.parametrize("value", [HUGE + "GB", HUGE, "8388608TiB", "9" * 5000, 10**400, 1 << 63, 1e300,
                                   float("inf"), float("nan")],
                         ids=["310-digit-GB", "310-digit", "2**63-as-TiB", "5000-digit", "int-10**400", "int-2**63",
                              "float-1e300", "inf", "nan"])  # fmt: skip
def test_parse_size_refuses_sizes_beyond_any_machine_as_a_value_error(value):
    with pytest.raises(ValueError, match="host_budget .*(beyond any machine|finite)"):
        parse_size(value, name="host_budget")


def test_parse_size_takes_the_largest_int64_size():
    assert (
        parse_size((1 << 63) - 1) == parse_size("8388607.9999999999990905052982270717620849609375TiB") == (1 << 63) - 1
    )


def test_parse_size_rejects_empty_string():
    with pytest.raises(ValueError):
        parse_size("")


def test_parse_size_rejects_negative_int():
    with pytest.raises(ValueError):
        parse_size(-1)


def test_parse_size_rejects_non_size_types():
    with pytest.raises((TypeError, ValueError)):
        parse_size(None)  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------- format_size


@pytest.mark.parametrize(
    "n, expected",
    [
        (3 * 2**29, "1.50 GiB"),
        (2**20, "1.00 MiB"),
        (1536, "1.50 KiB"),
        (3 * 2**40, "3.00 TiB"),
    ],
)
def test_format_size_examples(n, expected):
    assert format_size(n) == expected


def test_format_size_small_values_are_bytes():
    assert "0" in format_size(0) and format_size(0).endswith("B")
    assert "512" in format_size(512) and format_size(512).endswith("B")
    assert "KiB" not in format_size(512)


@settings(max_examples=60, deadline=None)
@given(st.integers(min_value=4, max_value=4095), st.sampled_from([10, 20, 30, 40]))
def test_format_then_parse_round_trips_exact_quarters(quarters, shift):
    # Multiples of a quarter unit print exactly with two decimals, so they parse back to the same count.
    n = quarters * (1 << shift) // 4
    text = format_size(n)
    assert text.endswith(("KiB", "MiB", "GiB", "TiB")), text
    assert parse_size(text.replace(" ", "")) == n, text


# ------------------------------------------------------------------------------------------------ IOConfig


def test_defaults_are_valid_and_documented_alignment():
    cfg = IOConfig()
    assert cfg.alignment == 4096
    assert cfg.direct in ("auto", "on", "off")
    assert cfg.threads >= 1 and cfg.queue_depth >= 1
    assert cfg.block_size > 0 and cfg.block_size % cfg.alignment == 0


def test_fields_are_keyword_only():
    with pytest.raises(TypeError):
        IOConfig(2**20)  # type: ignore[misc]


def test_frozen():
    cfg = IOConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.threads = 3  # type: ignore[misc]


def test_string_sizes_are_parsed():
    cfg = IOConfig(block_size="8MiB", alignment="4KiB")
    assert cfg.block_size == 8 * 2**20
    assert cfg.alignment == 4096
    assert IOConfig(block_size="1MiB") == IOConfig(block_size=2**20)


def test_explicit_values_are_kept():
    cfg = IOConfig(block_size=65536, threads=7, queue_depth=33, direct="off", alignment=2048)
    assert (cfg.block_size, cfg.threads, cfg.queue_depth, cfg.direct, cfg.alignment) == (
        65536,
        7,
        33,
        "off",
        2048,
    )


@pytest.mark.parametrize("direct", ["auto", "on", "off"])
def test_direct_modes_accepted(direct):
    assert IOConfig(direct=direct).direct == direct


@pytest.mark.parametrize(
    "field, value",
    [
        ("block_size", 0),
        ("block_size", -4096),
        ("block_size", "lots"),
        ("threads", 0),
        ("threads", -1),
        ("queue_depth", 0),
        ("queue_depth", -1),
        ("direct", "yes"),
        ("direct", ""),
        ("direct", None),
        ("alignment", 0),
        ("alignment", -4096),
        ("alignment", 3000),  # O_DIRECT alignment must be a power of two
    ],
)
def test_invalid_field_raises_value_error_naming_it(field, value):
    with pytest.raises(ValueError) as info:
        IOConfig(**{field: value})
    assert field in str(info.value), f"message should name {field!r}: {info.value}"


def test_replace_returns_new_validated_config():
    cfg = IOConfig(threads=2)
    new = cfg.replace(threads=8, block_size="2MiB")
    assert new.threads == 8 and new.block_size == 2 * 2**20
    assert cfg.threads == 2, "replace must not modify the original"
    assert new.queue_depth == cfg.queue_depth and new.direct == cfg.direct
    with pytest.raises(ValueError, match="threads"):
        cfg.replace(threads=0)


def test_to_dict_is_plain_json_and_rebuilds():
    cfg = IOConfig(block_size="256KiB", threads=3, queue_depth=9, direct="on")
    d = cfg.to_dict()
    assert set(d) == FIELDS
    assert json.loads(json.dumps(d)) == d
    assert IOConfig(**d) == cfg


CONFIGS = [
    IOConfig(),
    IOConfig(block_size="64KiB", threads=1, queue_depth=1, direct="off"),
    IOConfig(block_size="16MiB", threads=16, queue_depth=128, direct="on", alignment=4096),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=["defaults", "small", "large"])
def test_file_round_trip(tmp_path, cfg):
    path = tmp_path / "io.json"
    cfg.to_file(path)
    assert json.loads(path.read_text()) == cfg.to_dict(), "to_file writes the to_dict JSON"
    assert IOConfig.from_file(path) == cfg
    assert IOConfig.from_file(str(path)) == cfg


def test_from_file_accepts_string_sizes_and_partial_keys(tmp_path):
    path = tmp_path / "io.json"
    path.write_text(json.dumps({"block_size": "8MiB", "threads": 2}))
    cfg = IOConfig.from_file(path)
    assert cfg == IOConfig(block_size=8 * 2**20, threads=2)


def test_from_file_validates_values(tmp_path):
    path = tmp_path / "io.json"
    path.write_text(json.dumps({"queue_depth": 0}))
    with pytest.raises(ValueError, match="queue_depth"):
        IOConfig.from_file(path)


def test_from_file_rejects_unknown_key_naming_it(tmp_path):
    path = tmp_path / "io.json"
    path.write_text(json.dumps({"blok_size": 4096}))
    with pytest.raises((ValueError, TypeError)) as info:
        IOConfig.from_file(path)
    assert "blok_size" in str(info.value)


def test_from_file_rejects_malformed_json(tmp_path):
    path = tmp_path / "io.json"
    path.write_text("{not json")
    with pytest.raises(ValueError):
        IOConfig.from_file(path)


def test_from_env_without_variable_gives_defaults(monkeypatch):
    monkeypatch.delenv("TIERED_IO_CONFIG", raising=False)
    assert IOConfig.from_env() == IOConfig()


def test_from_env_reads_the_named_file(monkeypatch, tmp_path):
    cfg = IOConfig(block_size="2MiB", threads=5, queue_depth=17, direct="off")
    path = tmp_path / "env_io.json"
    cfg.to_file(path)
    monkeypatch.setenv("TIERED_IO_CONFIG", str(path))
    assert IOConfig.from_env() == cfg


@pytest.mark.parametrize("name", ["missing.json", "."], ids=["missing", "a-folder"])
def test_from_env_with_no_file_to_read_names_the_variable(monkeypatch, tmp_path, name):
    # A variable pointing nowhere is a mistake, and silently using the defaults would hide it. A ValueError
    # naming the variable: the optimizer's callers read an OSError as its folder's (examples/train.py did).
    monkeypatch.setenv("TIERED_IO_CONFIG", str(tmp_path / name))
    with pytest.raises(ValueError, match=r"\$TIERED_IO_CONFIG names .*unset TIERED_IO_CONFIG"):
        IOConfig.from_env()


@pytest.mark.parametrize(
    "content",
    ['{"threads": 0}', '{"threads": 4, "bogus": 1}', '{"block_size": null}', "{no", "\udcff"],
    ids=["value", "unknown-key", "type", "not-json", "not-text"],
)
def test_from_env_with_a_bad_file_names_the_variable_and_the_file(monkeypatch, tmp_path, content):
    # The setting lives outside the program (a shell profile, a job script): the message says where to look.
    path = tmp_path / "io.json"
    path.write_bytes(content.encode("utf-8", "surrogateescape"))
    monkeypatch.setenv("TIERED_IO_CONFIG", str(path))
    with pytest.raises(ValueError, match=r"\$TIERED_IO_CONFIG names .*io\.json.*unset TIERED_IO_CONFIG"):
        IOConfig.from_env()
