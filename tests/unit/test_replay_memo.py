"""The allocator-replay memo (launcher/memory/replay.py `ReplayMemo`): a remembered replay gives
the replay's own answer, and any change of what is replayed is another key."""
import dataclasses

from launcher.memory.common import Layout
from launcher.memory.replay import ReplayMemo, peak_reserved_bytes

from tests.unit.test_memory_models import synthetic_trace


def _layout(num_layers=2):
    layout = Layout.of(synthetic_trace(num_layers))
    layout.add("bucket", "gradients", 3 << 20, 1, 5)
    return layout


def test_remembered_replay_equals_the_replay(tmp_path):
    layout = _layout()
    plain = peak_reserved_bytes(layout, 80, 10 << 20)
    memo = ReplayMemo(tmp_path)
    assert peak_reserved_bytes(layout, 80, 10 << 20, memo=memo) == plain
    memo.save()
    again = ReplayMemo(tmp_path)
    assert again.get(again.key(layout, 80, False)) is not None
    assert peak_reserved_bytes(layout, 80, 10 << 20, memo=again) == plain


def test_what_is_replayed_is_in_the_key(tmp_path):
    memo = ReplayMemo(tmp_path)
    base = _layout()
    key = memo.key(base, 80, False)
    assert memo.key(_layout(), 80, False) == key
    assert memo.key(base, 90, False) != key  # cuBLAS workspaces
    assert memo.key(base, 80, True) != key  # expandable segments
    assert memo.key(_layout(3), 80, False) != key
    bigger = _layout()
    bigger.terms[0] = dataclasses.replace(bigger.terms[0], nbytes=4 << 20)
    assert memo.key(bigger, 80, False) != key
    fewer = _layout()
    fewer.mask[3] = False
    assert memo.key(fewer, 80, False) != key
    later = _layout()
    later.free = later.free.copy()
    later.free[1] += 1
    assert memo.key(later, 80, False) != key


def test_an_unreadable_memo_is_empty(tmp_path):
    (tmp_path / "replays.json").write_text("{torn")
    memo = ReplayMemo(tmp_path)
    layout = _layout()
    assert peak_reserved_bytes(layout, 80, 0, memo=memo) == peak_reserved_bytes(layout, 80, 0)
    memo.save()
    assert ReplayMemo(tmp_path).get(memo.key(layout, 80, False)) is not None
