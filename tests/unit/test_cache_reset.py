"""The marker through which a client resets the caches of every model instance (triton/cache_reset.py): each
instance sees one reset once, whenever it looks and however soon after another it comes; a marker from before
an instance started, a missing one and none configured ask for nothing."""

import os

from specdec.triton import cache_reset, marker_file


def test_each_watcher_sees_each_reset_once(tmp_path):
    path = str(tmp_path / "marker")
    early, never = marker_file.Watch(path), marker_file.Watch("")
    assert not early.due()  # no marker yet
    cache_reset.request(path)
    late = marker_file.Watch(path)  # started after that reset: not one of its caches'
    assert early.due() and not early.due() and not late.due()
    for _ in range(3):  # resets in quick succession: each is new (another file, another time to the nanosecond)
        cache_reset.request(path)
        assert early.due() and late.due() and not early.due()
    cache_reset.request(path)
    cache_reset.request(path)
    assert early.due() and not early.due()  # two before it looked: one reset
    assert not never.due()
    assert sorted(os.listdir(tmp_path)) == ["marker"]  # no scratch file left behind


def test_a_removed_marker_asks_for_nothing_and_a_new_one_does(tmp_path):
    path = tmp_path / "marker"
    cache_reset.request(str(path))
    watch = marker_file.Watch(str(path))
    path.unlink()
    assert not watch.due()
    cache_reset.request(str(path))
    assert watch.due()


def test_the_launchers_marker_is_one_per_server():
    assert cache_reset.marker(8000) != cache_reset.marker(18000)
    assert cache_reset.marker(8000).name == "specdec-cache-reset-8000"
