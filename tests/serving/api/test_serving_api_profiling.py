"""``profiling.profiled``: the process's profile under ``APEX_SERVING_PROFILE``, nothing without it."""

import pstats

from serving.api.profiling import PROFILE_ENV, profiled


def busy() -> int:
    return sum(i * i for i in range(10_000))


def test_profiled_writes_the_profile_where_the_variable_says(tmp_path, monkeypatch):
    monkeypatch.setenv(PROFILE_ENV, str(tmp_path / "profiles"))
    with profiled("loop"):
        busy()
    stats = pstats.Stats(str(tmp_path / "profiles" / "loop.prof")).stats
    assert "busy" in {function for _, _, function in stats}


def test_profiled_without_the_variable_profiles_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv(PROFILE_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    with profiled("loop"):
        busy()
    assert list(tmp_path.iterdir()) == []
