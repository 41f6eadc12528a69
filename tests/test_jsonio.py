"""LoKA's JSON files (loka/jsonio.py): the envelope, the size limit, junk rejected before
it is parsed, and one error type, ReportError, naming the file and the field."""

import json

import pytest

from loka import jsonio
from loka.jsonio import ReportError, decode_number, field_int, field_number, read_json

SCHEMA = "loka.test"


def _write(tmp_path, content, name="f.json"):
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content if isinstance(content, str) else json.dumps(content))
    return path


def test_a_valid_envelope_reads_back(tmp_path):
    path = _write(tmp_path, {"schema": SCHEMA, "version": 1, "x": [1, 2.5, "inf"]})
    assert read_json(path, SCHEMA, 1)["x"] == [1, 2.5, "inf"]


@pytest.mark.parametrize("version", [True, 1.0, "1", None, [1]])
def test_version_must_be_the_integer(tmp_path, version):
    # issue 29: "version": true was read as version 1 (True == 1 in Python)
    path = _write(tmp_path, {"schema": SCHEMA, "version": version})
    with pytest.raises(ReportError, match="version") as info:
        read_json(path, SCHEMA, 1)
    assert str(path) in str(info.value)


HOSTILE = [
    ("[" * 100_000 + "]" * 100_000, "not a loka.test file"),
    ('{"schema": "loka.test", "version": 1, "x": ' + "[" * 100_000 + "]" * 100_000 + "}",
     "nested too deeply"),
    ("{not json", "not valid JSON"),
    (b"\xff\xfe\x00garbage", "not valid JSON"),
    ("", "empty"),
    ("   \n", "empty"),
    ("12345", "not a loka.test file"),
]


@pytest.mark.parametrize("content,match", HOSTILE,
                         ids=["deep-list", "deep-field", "not-json",
                              "not-utf8", "empty", "blank", "a-number"])
def test_hostile_files_give_one_report_error_naming_the_file(tmp_path, content, match):
    path = _write(tmp_path, content)
    with pytest.raises(ReportError, match=match) as info:
        read_json(path, SCHEMA, 1)
    text = str(info.value)
    assert text.startswith(str(path)) and "\n" not in text and len(text) < 400


@pytest.mark.parametrize("digits", [5000, 30])
def test_long_integers_are_read_as_floats_that_integer_fields_refuse(tmp_path, digits):
    # Python refuses int() of more than 4300 digits with a bare ValueError, and float() of
    # a long int with OverflowError: a long literal is read as JSON reads 1e999
    path = _write(tmp_path, '{"schema": "loka.test", "version": 1, "x": -' + "7" * digits + "}")
    x = read_json(path, SCHEMA, 1)["x"]
    assert isinstance(x, float) and x < -1e29
    with pytest.raises(ReportError, match="a.x: expected an integer"):
        field_int({"x": x}, "x", "a")


def test_files_above_the_size_limit_are_refused_before_reading(tmp_path, monkeypatch):
    path = _write(tmp_path, {"schema": SCHEMA, "version": 1, "x": list(range(1000))})
    size = path.stat().st_size
    with pytest.raises(ReportError, match="limit") as info:
        read_json(path, SCHEMA, 1, max_bytes=size - 1)
    assert str(path) in str(info.value) and "max_bytes" in str(info.value)
    assert read_json(path, SCHEMA, 1, max_bytes=size)["version"] == 1
    monkeypatch.setattr(jsonio, "MAX_FILE_BYTES", size - 1)  # the module-wide default
    with pytest.raises(ReportError, match="limit"):
        read_json(path, SCHEMA, 1)


def test_default_size_limit_is_64_mib():
    assert jsonio.MAX_FILE_BYTES == 64 * 2 ** 20


def test_foreign_envelopes_are_refused_before_the_body_is_parsed(tmp_path):
    # the body is not even JSON: an error about the envelope shows it was never parsed
    body = ', "x": [0.5, 0.5, ' + "0.5, " * 1000 + "this is not JSON"
    path = _write(tmp_path, '{\n "schema": "loka.other",\n "version": 1' + body)
    with pytest.raises(ReportError, match="not a loka.test file .schema: 'loka.other'"):
        read_json(path, SCHEMA, 1)
    path = _write(tmp_path, '{"schema": "loka.test", "version": 7' + body, "g.json")
    with pytest.raises(ReportError, match="version 7 is not supported"):
        read_json(path, SCHEMA, 1)
    path = _write(tmp_path, '{"schema": "loka.test", "version": true' + body, "h.json")
    with pytest.raises(ReportError, match="version True is not supported"):
        read_json(path, SCHEMA, 1)
    for junk in ("[0.5, 0.5]", "0.5 0.5 0.5", '"text"'):
        with pytest.raises(ReportError, match="does not hold a JSON object"):
            read_json(_write(tmp_path, junk + body, "i.json"), SCHEMA, 1)


@pytest.mark.parametrize("value", [10 ** 400, -(10 ** 400)], ids=["1e400", "-1e400"])
def test_numbers_beyond_float_are_report_errors(value):
    with pytest.raises(ReportError, match="number"):
        decode_number(value)
    with pytest.raises(ReportError, match="a.x: expected a number"):
        field_number({"x": value}, "x", "a")


@pytest.mark.parametrize("value", [2 ** 63, 10 ** 30, float("inf"), 1e999, True, "3", None],
                         ids=["2^63", "1e30", "inf", "1e999", "true", "str", "null"])
def test_integers_are_bounded(value):
    with pytest.raises(ReportError, match="a.x: expected an integer"):
        field_int({"x": value}, "x", "a")
    assert field_int({"x": 2 ** 63 - 1}, "x", "a") == 2 ** 63 - 1


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temp_file(tmp_path):
    from loka.jsonio import atomic_write, atomic_write_text

    path = tmp_path / "plan.json"
    atomic_write_text(path, '{"old": 1}')

    def broken(f):
        f.write('{"new": ')
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        atomic_write(path, broken)
    assert path.read_text() == '{"old": 1}'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]
    atomic_write(path, lambda f: f.write(b"\x00\x01"), binary=True, temp=str(tmp_path / ".t"))
    assert path.read_bytes() == b"\x00\x01" and not (tmp_path / ".t").exists()
