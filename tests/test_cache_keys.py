"""bench/cache_keys.py: every process's compile-cache keys, and what differs between them."""

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import cache_keys  # noqa: E402


def _log(path: Path, entries):
    lines = []
    for cache, key, parts in entries:
        name = "FX" if cache == "fx" else "Autograd"
        lines.append(f"@@ torch.x {name} graph cache hash details for key {key}:")
        lines += parts
        lines.append("@@ torch.x another message")
        lines.append("not a part")
    path.write_text("\n".join(lines) + "\n")


def test_compare_counts_shared_keys_and_names_the_parts_that_differ(tmp_path):
    common = ["[a] gm: <lambda>()", "[b] example_inputs[0]: float32 (64, 256)"]
    _log(tmp_path / "10-1.log", [("aot", "k1", common + ["[c] inductor_config: x=1"]),
                                 ("aot", "k2", ["[z] gm: other()"])])
    _log(tmp_path / "11-10.log", [("aot", "k1", common + ["[c] inductor_config: x=1"]),
                                  ("aot", "k3", common + ["[d] inductor_config: x=2"])])
    (tmp_path / "12-10.log").write_text("")  # a process that compiled nothing
    (tmp_path / "root.json").write_text(json.dumps({"pid": 10, "command": ["x"]}))
    out = cache_keys.compare(str(tmp_path))
    by_pid = {p["pid"]: p for p in out["processes"]}
    assert set(by_pid) == {10, 11}
    parent, child = by_pid[10], by_pid[11]
    assert parent["command"] and not child["command"]
    assert parent["caches"]["aot"] == {
        "keys": 2, "shared": 1, "unshared": 1,
        "differences": [{"key": "k2", "nearest": "k1", "only_here": ["[z] gm: other()"],
                         "only_there": sorted(common + ["[c] inductor_config: x=1"])}]}
    diff = child["caches"]["aot"]["differences"]
    assert child["caches"]["aot"]["shared"] == 1
    # k3's nearest is k1 (two parts in common, against none with k2): only the option differs
    assert diff == [{"key": "k3", "nearest": "k1",
                     "only_here": ["[d] inductor_config: x=2"],
                     "only_there": ["[c] inductor_config: x=1"]}]
    assert child["caches"]["fx"] == {"keys": 0, "shared": 0, "unshared": 0, "differences": []}


def test_compare_refuses_a_missing_or_empty_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such directory"):
        cache_keys.compare(str(tmp_path / "nope"))
    (tmp_path / "5-1.log").write_text("nothing here\n")
    with pytest.raises(ValueError, match="holds no cache keys"):
        cache_keys.compare(str(tmp_path))


def test_the_cli_says_what_is_wrong_in_one_line(tmp_path, capsys):
    for argv in (["run", "--dir", str(tmp_path)], ["compare", "--dir", str(tmp_path), "--", "x"],
                 ["compare", "--dir", str(tmp_path / "nope")]):
        with pytest.raises(SystemExit) as e:
            cache_keys.main(argv)
        assert e.value.code == 2
        assert len(capsys.readouterr().err.strip().splitlines()[-1]) > 0
    with pytest.raises(ValueError, match="needs a command"):
        cache_keys.run(str(tmp_path), [])


_SCRIPT = textwrap.dedent("""
    import subprocess, sys
    import torch
    role = sys.argv[1] if len(sys.argv) > 1 else "parent"
    if role == "other":  # a process whose Inductor option differs
        import torch._inductor.config as c
        c.max_fusion_size = 33
    f = torch.compile(lambda x: (x * 2).sin().sum(0), dynamic=False)
    f(torch.randn(8, 4))
    if role == "parent":
        for child in ("like", "other"):
            subprocess.run([sys.executable, __file__, child], check=True)
""")


def test_a_parent_and_its_children_share_a_key_unless_an_option_differs(tmp_path):
    script = tmp_path / "prog.py"
    script.write_text(_SCRIPT)
    env_dir = tmp_path / "keys"
    old = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / "inductor")
    try:
        rc = cache_keys.run(str(env_dir), [sys.executable, str(script)])
    finally:
        if old is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR")
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = old
    assert rc == 0
    out = cache_keys.compare(str(env_dir))
    procs = out["processes"]
    assert len(procs) == 3
    parent = next(p for p in procs if p["command"])
    children = [p for p in procs if not p["command"]]
    assert all(p["ppid"] == parent["pid"] for p in children)
    # the like child looked up the parent's AOTAutograd key; the other one did not
    shared = sorted(p["caches"]["aot"]["shared"] for p in children)
    assert shared == [0, 1], procs
    other = next(p for p in children if p["caches"]["aot"]["shared"] == 0)
    diff = other["caches"]["aot"]["differences"][0]
    assert any("max_fusion_size" in line for line in diff["only_here"] + diff["only_there"]), diff
    assert not any(line.startswith("[") and "gm:" in line
                   for line in diff["only_here"]), "the graph itself is the same"
