import math

import pytest
import torch

from loka.data import CriteoFormatError, CriteoReader, criteo_feature_spec, sample_path


def _line(label="1", dense=None, cats=None):
    dense = ["1"] * 13 if dense is None else dense
    cats = ["68fd1e64"] * 26 if cats is None else cats
    return "\t".join(([label] if label is not None else []) + dense + cats)


def test_sample_file_reads():
    reader = CriteoReader(sample_path(), 64, table_sizes=1000)
    batches = list(reader)
    assert [b.batch_size for b in batches] == [64, 64, 64, 8]
    b = batches[0]
    assert b.dense.shape == (64, 13) and (b.dense >= 0).all()
    assert set(b.sparse) == {f"C{i}" for i in range(1, 27)}
    assert all(int(j.values.max()) < 1000 for j in b.sparse.values())
    assert set(torch.cat([x.labels for x in batches]).unique().tolist()) == {0.0, 1.0}
    assert reader.feature_spec == criteo_feature_spec(1000)
    assert reader.num_skipped == 0


def test_transforms(tmp_path):
    dense = ["", "-1", "0", "3"] + ["7"] * 9
    cats = ["", "ff"] + ["10"] * 24
    path = tmp_path / "x.tsv"
    path.write_text(_line("0", dense, cats) + "\n")
    b = next(iter(CriteoReader(path, 4, table_sizes=100)))
    assert b.dense[0, :4].tolist() == pytest.approx([0.0, 0.0, 0.0, math.log(4.0)])
    assert b.sparse["C1"].values.tolist() == [0]          # missing -> 0
    assert b.sparse["C2"].values.tolist() == [255 % 100]  # hex, hashed into the table
    assert b.sparse["C1"].offsets.tolist() == [0, 1] and b.labels.tolist() == [0.0]


def test_no_label_layout(tmp_path):
    path = tmp_path / "test.tsv"
    path.write_text(_line(None) + "\n" + _line(None) + "\n")
    b = next(iter(CriteoReader(path, 8, has_label=False)))
    assert b.batch_size == 2 and b.labels.tolist() == [0.0, 0.0]


@pytest.mark.parametrize("bad,why", [
    (_line("2"), "label"),
    (_line("1", dense=["x"] + ["1"] * 12), "invalid literal"),
    (_line("1", cats=["zz"] + ["1"] * 25), "invalid literal"),
    ("1\t2\t3", "expected 40"),
])
def test_malformed_line_names_line_number(tmp_path, bad, why):
    path = tmp_path / "bad.tsv"
    path.write_text("\n".join([_line(), _line(), bad, _line()]) + "\n")
    with pytest.raises(CriteoFormatError, match=rf"bad.tsv:3: .*{why}"):
        list(CriteoReader(path, 2))
    reader = CriteoReader(path, 2, skip_malformed=True)
    assert sum(b.batch_size for b in reader) == 3 and reader.num_skipped == 1


def test_resume_position_and_loop(tmp_path):
    r = CriteoReader(sample_path(), 50)
    it = iter(r)
    for _ in range(2):
        next(it)
    state = r.state_dict()
    rest = list(it)
    r2 = CriteoReader(sample_path(), 50)
    r2.load_state_dict(state)
    rest2 = list(r2)
    assert len(rest) == len(rest2) == 2
    assert all(torch.equal(a.dense, b.dense) for a, b in zip(rest, rest2))
    looped = CriteoReader(sample_path(), 150, loop=True, drop_last=True)
    it = iter(looped)
    a, b = next(it), next(it)
    assert torch.equal(a.dense, b.dense)  # 200 lines: one full batch per pass


def test_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        CriteoReader(tmp_path / "none.tsv", 4)
    with pytest.raises(ValueError):
        CriteoReader(sample_path(), 4, table_sizes=[10] * 25)
