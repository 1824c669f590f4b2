import json
import os

from specmd.results import write_json_atomic


def test_results_json_is_atomic_and_gets_the_umask_mode(tmp_path):
    old = os.umask(0o022)
    try:
        write_json_atomic(tmp_path / "results.json", {"a": 1.0, "b": float("nan")})
    finally:
        os.umask(old)
    path = tmp_path / "results.json"
    assert json.loads(path.read_text()) == {"a": 1.0, "b": None}  # NaN is not JSON: written as null
    assert path.stat().st_mode & 0o777 == 0o644  # 0666 less the umask, not mkstemp's 0600
    assert [p.name for p in tmp_path.iterdir()] == ["results.json"]  # no temporary left behind
