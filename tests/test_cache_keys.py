"""bench/cache_keys.py: every process's compile-cache keys, and what differs between them."""

import json
import os
import subprocess
import sys
import tempfile
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
    common = ["[a] gm: <lambda>()", "    return (x,)", "[b] example_inputs[0]: (64, 256)"]
    _log(tmp_path / "10-1.log", [("aot", "k1", common + ["[c] inductor_config: x=1"]),
                                 ("aot", "k2", ["[z] gm: other()"])])
    _log(tmp_path / "11-10.log", [("aot", "k1", common + ["[c] inductor_config: x=1"]),
                                  ("aot", "k3", common + ["[d] inductor_config: x=2",
                                                          "more of the pickle"])])
    (tmp_path / "12-10.log").write_text("")  # a process that compiled nothing
    (tmp_path / "notes.log").write_text("not a log of run\n")  # skipped
    (tmp_path / "root.json").write_text(json.dumps({"pid": 10, "command": ["x"]}))
    out = cache_keys.compare(str(tmp_path))
    by_pid = {p["pid"]: p for p in out["processes"]}
    assert set(by_pid) == {10, 11}
    parent, child = by_pid[10], by_pid[11]
    assert parent["command"] and not child["command"]
    assert parent["caches"]["aot"] == {
        "keys": 2, "shared": 1, "unshared": 1,
        "differences": [{"key": "k2", "nearest": "k1", "parts": [
            {"part": "example_inputs[0]", "here": None, "there": "(64, 256)"},
            {"part": "gm", "here": "other()", "there": "<lambda>()\n    return (x,)"},
            {"part": "inductor_config", "here": None, "there": "x=1"}]}]}
    diff = child["caches"]["aot"]["differences"]
    assert child["caches"]["aot"]["shared"] == 1
    # k3's nearest is k1 (the graph and its input hash alike): only the option differs, and
    # its value's second line is joined to it
    assert diff == [{"key": "k3", "nearest": "k1", "parts": [
        {"part": "inductor_config", "here": "x=2\nmore of the pickle", "there": "x=1"}]}]
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
    used = tmp_path / "used"
    used.mkdir()
    (used / "5-1.log").write_text("")
    with pytest.raises(ValueError, match="logs of an earlier run"):
        cache_keys.run(str(used), [sys.executable, "-c", "pass"])
    with pytest.raises(SystemExit) as e:  # a command that is not there
        cache_keys.main(["run", "--dir", str(tmp_path / "new"), "--", str(tmp_path / "nope")])
    assert e.value.code == 2 and "run:" in capsys.readouterr().err


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
    names = [d["part"] for d in diff["parts"]]
    # the graph and its inputs hash alike: what differs is the Inductor options' part
    assert names and all("config" in n for n in names), names
    assert "gm" not in names and not any(n.startswith("example_inputs") for n in names)


def test_a_forked_child_logs_to_a_file_of_its_own_and_stderr_stays_quiet(tmp_path):
    """A child forked after startup (as multiprocessing and DataLoader workers are) names
    its own file when it first logs; the DEBUG lines do not reach the command's stderr."""
    script = tmp_path / "fork.py"
    script.write_text(textwrap.dedent("""
        import os
        import torch
        f = torch.compile(lambda x: x.cos() * 3, dynamic=False)
        pid = os.fork()
        if pid == 0:
            torch.compile(lambda x: x.sin() + 1, dynamic=False)(torch.randn(4))
            os._exit(0)
        os.waitpid(pid, 0)
        f(torch.randn(5))
    """))
    err = tmp_path / "err.txt"
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "cache_keys.py"), "run",
                           "--dir", str(tmp_path / "keys"), "--", sys.executable, str(script)],
                          env=env, stderr=open(err, "w"), timeout=600)
    assert done.returncode == 0, err.read_text()[-2000:]
    assert "hash details" not in err.read_text()
    procs = cache_keys.compare(str(tmp_path / "keys"))["processes"]
    assert len(procs) == 2
    assert sorted(p["caches"]["aot"]["keys"] for p in procs) == [1, 1]


def test_the_sitecustomize_it_shadows_still_runs(tmp_path, monkeypatch):
    other = tmp_path / "other"
    other.mkdir()
    marker = tmp_path / "ran.txt"
    (other / "sitecustomize.py").write_text(f"open({str(marker)!r}, 'w').write('yes')\n")
    monkeypatch.setenv("PYTHONPATH", str(other))
    made = []
    real = tempfile.mkdtemp
    monkeypatch.setattr(tempfile, "mkdtemp", lambda **kw: made.append(real(**kw)) or made[-1])
    assert cache_keys.run(str(tmp_path / "keys"), [sys.executable, "-c", "pass"]) == 0
    assert marker.read_text() == "yes"
    assert len(made) == 1 and not Path(made[0]).exists()  # its own module is removed
