"""`python -m ac2_dist.report`: every bad run file or chart path gives one clear line on
stderr and exit status 2; inconsistent but valid files render with a warning line."""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import pytest

from ac2_dist import memory
from ac2_dist.report import main as report_main


def _entry(rank: int = 0, world_size: int = 2, **fields) -> dict:
    d = memory.RankReport(rank=rank, world_size=world_size, saved_bytes=1024).to_dict()
    d.update(fields)
    return d


def _write(tmp_path, data, name: str = "run.json") -> str:
    path = os.path.join(tmp_path, name)
    with open(path, "w") as f:
        f.write(data if isinstance(data, str) else json.dumps(data))
    return path


def _run(capsys, *argv: str) -> tuple[int, str, list[str]]:
    code = report_main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err.splitlines()


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _run_file(*entries) -> dict:
    return {"schema_version": memory.SCHEMA_VERSION, "ranks": list(entries)}


BAD_RANKS = {
    "rank entry is a string": (["rank 0"], "ranks[0]: a rank report must be a JSON object (dict), got string"),
    "rank entry is null": ([_entry(), None], "ranks[1]: a rank report must be a JSON object (dict), got null"),
    "rank entry is a list": ([[1, 2]], "ranks[0]: a rank report must be a JSON object (dict), got list"),
    "rank is a string": ([_entry(rank="0")], "ranks[0]: field rank must be an integer, got string '0'"),
    "rank is a bool": ([_entry(rank=True)], "field rank must be an integer, got boolean"),
    "rank is negative": ([_entry(rank=-1)], "field rank must be >= 0"),
    "world_size is 0": ([_entry(world_size=0)], "field world_size must be >= 1"),
    "bytes are a float": ([_entry(saved_bytes=1.5)], "field saved_bytes must be an integer, got number 1.5"),
    "bytes are null": ([_entry(peak_bytes_backward=None)], "field peak_bytes_backward must be an integer, got null"),
    "device is a number": ([_entry(device=0)], "field device must be a string"),
    "replay time is a string": ([_entry(replay_seconds="1s")], "field replay_seconds must be a number"),
    "by-reason is a list": ([_entry(saved_bytes_by_reason=[1, 2])], "field saved_bytes_by_reason must be an object"),
    "by-reason value is a string": ([_entry(saved_bytes_by_reason={"policy": "1"})],
                                    "field saved_bytes_by_reason['policy'] must be an integer"),
    "per_module is a list": ([_entry(per_module=[])], "field per_module must be an object"),
    "per_module entry is a list": ([_entry(per_module={"layers.0": [1]})], "field per_module['layers.0'] must be an object"),
    "per_module value is null": ([_entry(per_module={"a": {"saved_bytes": None}})],
                                 "per_module['a']['saved_bytes'] must be an integer, got null"),
    "missing fields": ([{"schema_version": memory.SCHEMA_VERSION, "rank": 0}],
                       "report is missing field(s) world_size, device, peak_bytes_forward"),
    "entry schema_version": ([_entry(schema_version=7)], "ranks[0]: report schema_version 7 is not supported"),
}

BAD_FILES = {
    "top level is a list": ("[]", "is not a run file"),
    "top level is null": ("null", "is not a run file"),
    "ranks is a dict": (json.dumps({"schema_version": 1, "ranks": {}}), "is not a run file"),
    "no schema_version": (json.dumps({"ranks": []}), "has schema_version None, expected 1"),
    "not JSON": ("{ranks: oops", "is not JSON"),
    "empty file": ("", "is not JSON"),
    "not UTF-8": ("\udcff", "is not JSON"),
}


@pytest.mark.parametrize("ranks, message", BAD_RANKS.values(), ids=list(BAD_RANKS))
def test_malformed_rank_entries_one_line_exit_2(tmp_path, capsys, ranks, message):
    path = _write(tmp_path, _run_file(*ranks))
    code, out, err = _run(capsys, path)
    assert code == 2 and out == ""
    assert len(err) == 1, err
    assert err[0].startswith("python -m ac2_dist.report: error: ") and path in err[0]
    assert message in err[0], err[0]
    with pytest.raises(ValueError, match="ranks\\["):  # library users get the same message
        memory.load_run(path)


@pytest.mark.parametrize("text, message", BAD_FILES.values(), ids=list(BAD_FILES))
def test_malformed_files_one_line_exit_2(tmp_path, capsys, text, message):
    path = os.path.join(tmp_path, "run.json")
    with open(path, "w", encoding="utf-8", errors="surrogateescape") as f:
        f.write(text)
    code, out, err = _run(capsys, path)
    assert code == 2 and out == ""
    assert len(err) == 1 and path in err[0] and message in err[0], err


@pytest.mark.parametrize("make", [lambda d: os.path.join(d, "missing.json"), lambda d: str(d)],
                         ids=["missing", "directory"])
def test_unreadable_path_one_line_exit_2(tmp_path, capsys, make):
    path = make(tmp_path)
    code, out, err = _run(capsys, path)
    assert code == 2 and out == ""
    assert len(err) == 1 and f"cannot read {path}: " in err[0], err


def test_from_dict_validates_for_library_users():
    with pytest.raises(ValueError, match="field recomputed_ops must be an integer, got string 'many'"):
        memory.RankReport.from_dict(_entry(recomputed_ops="many"))
    with pytest.raises(ValueError, match="must be a JSON object"):
        memory.RankReport.from_dict(["not", "a", "dict"])
    # Fields added within schema 1 are optional; unknown keys are ignored.
    d = _entry()
    del d["steps"], d["live_bytes_after_forward"]
    d["added_later"] = {"x": 1}
    r = memory.RankReport.from_dict(d)
    assert r.steps == 0 and r.live_bytes_after_forward == 0 and r.saved_bytes == 1024
    assert memory.RankReport.from_dict(_entry(replay_seconds=2)).replay_seconds == 2.0


def test_every_report_field_is_validated():
    fields = {f.name for f in dataclasses.fields(memory.RankReport)}
    assert set(memory._FIELD_CHECKS) == fields


@pytest.mark.parametrize(
    "ranks, warning",
    [
        ([_entry(0), _entry(0)], "duplicate rank(s) [0]"),
        ([_entry(0), _entry(2)], "rank(s) [2] not below world_size (2)"),
        ([_entry(0), _entry(1, world_size=4)], "mixed world sizes [2, 4]"),
        ([], "no rank reports"),
    ],
    ids=["duplicate", "out-of-range", "mixed-world-sizes", "empty"],
)
def test_inconsistent_runs_warn_and_still_render(tmp_path, capsys, ranks, warning):
    path = _write(tmp_path, _run_file(*ranks))
    code, out, err = _run(capsys, path)
    assert code == 0
    assert ("saved after forward" in out) if ranks else ("(no reports)" in out)
    assert len(err) == 1 and err[0].startswith(f"python -m ac2_dist.report: warning: {path}: {warning}"), err
    with pytest.warns(UserWarning, match=f"{path}: "):
        memory.load_run(path)


def test_consistent_run_has_no_warning(tmp_path, capsys):
    path = _write(tmp_path, _run_file(_entry(1), _entry(0)))
    code, out, err = _run(capsys, path)
    assert code == 0 and err == [] and "rank 1" in out


@pytest.mark.parametrize("name", ["out.jpg", "out.svg", "out"])
def test_png_with_another_extension_exit_2_after_the_table(tmp_path, capsys, name):
    path = _write(tmp_path, _run_file(_entry(0), _entry(1)))
    png = os.path.join(tmp_path, name)
    code, out, err = _run(capsys, path, "--png", png)
    assert code == 2 and "saved after forward" in out
    assert len(err) == 1 and "ending in .png" in err[0] and png in err[0], err
    assert not os.path.exists(png)


@pytest.mark.skipif(not _has_matplotlib(), reason="matplotlib (the 'plot' extra) not installed")
@pytest.mark.parametrize("where", ["no-such-dir/out.png", "run.json/out.png"], ids=["missing-dir", "file-as-dir"])
def test_png_to_unwritable_path_exit_2_after_the_table(tmp_path, capsys, where):
    path = _write(tmp_path, _run_file(_entry(0), _entry(1)))
    png = os.path.join(tmp_path, where)
    code, out, err = _run(capsys, path, "--png", png)
    assert code == 2 and "saved after forward" in out
    assert len(err) == 1 and f"cannot write {png}: " in err[0], err


def test_png_without_matplotlib_exit_2_after_the_table(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    path = _write(tmp_path, _run_file(_entry(0), _entry(1)))
    png = os.path.join(tmp_path, "out.png")
    code, out, err = _run(capsys, path, "--png", png)
    assert code == 2 and "saved after forward" in out
    assert len(err) == 1 and "needs matplotlib" in err[0] and "pip install" in err[0], err
    assert not os.path.exists(png)


@pytest.mark.skipif(not _has_matplotlib(), reason="matplotlib (the 'plot' extra) not installed")
def test_png_written(tmp_path, capsys):
    path = _write(tmp_path, _run_file(_entry(0), _entry(1)))
    png = os.path.join(tmp_path, "out.PNG")
    code, out, err = _run(capsys, path, "--png", png)
    assert code == 0 and err == [] and f"wrote {png}" in out
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
