"""A lean live-storage tracker: peak bytes of every tensor storage created on this thread.

The same accounting as torch's `MemTracker` (torch/distributed/_tools/mem_tracker.py): a
`TorchDispatchMode` sees each op's outputs; a storage not seen before is added with its
`nbytes()`, a weakref callback subtracts it when the storage is freed, and
`UntypedStorage.resize_` (which no dispatch mode sees) is patched to account size changes.
It skips MemTracker's per-module bookkeeping (module hooks, a snapshot per module per op),
which costs most of its time, and labels each storage with the training phase that allocated
it (`setup`, `forward`, `backward`, `optimizer`) instead of MemTracker's categories.
"""
from __future__ import annotations

import weakref
from functools import wraps

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary


class _Entry:
    __slots__ = ("num_bytes", "phase", "ref")

    def __init__(self, num_bytes: int, phase: str) -> None:
        self.num_bytes, self.phase, self.ref = num_bytes, phase, None


class StorageTracker(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.phase = "setup"
        self.live_bytes = 0
        self.peak_bytes = 0
        self.live_by_phase: dict[str, int] = {}
        self.peak_by_phase: dict[str, int] = {}
        self._entries: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._orig_resize = torch.UntypedStorage.resize_

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes
        self.peak_by_phase = dict(self.live_by_phase)

    def _change(self, phase: str, delta: int) -> None:
        self.live_bytes += delta
        self.live_by_phase[phase] = self.live_by_phase.get(phase, 0) + delta
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes
            self.peak_by_phase = dict(self.live_by_phase)

    def _freed(self, entry: _Entry, _ref) -> None:
        self._change(entry.phase, -entry.num_bytes)

    def _track_storage(self, st: torch.UntypedStorage) -> None:
        entry = self._entries.get(st)
        if entry is None:
            entry = _Entry(st.nbytes(), self.phase)
            entry.ref = weakref.ref(st, lambda ref, e=entry: self._freed(e, ref))
            self._entries[st] = entry
            self._change(entry.phase, entry.num_bytes)
        elif entry.num_bytes != st.nbytes():
            self._change(entry.phase, st.nbytes() - entry.num_bytes)
            entry.num_bytes = st.nbytes()

    def track_tensor(self, t: torch.Tensor) -> None:
        """A wrapper subclass (DTensor: FSDP2's sharded parameters and their optimizer states,
        tensor-parallel activations) owns no memory; its inner tensors do (`__tensor_flatten__`,
        as MemTracker does, torch/distributed/_tools/common_utils.py `get_untyped_storages`). Its own
        `untyped_storage()` reports the global size."""
        if is_traceable_wrapper_subclass(t):
            for name in t.__tensor_flatten__()[0]:
                self.track_tensor(getattr(t, name))
        elif isinstance(t, torch.Tensor) and t.layout == torch.strided and not t.is_meta:
            self._track_storage(t.untyped_storage())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            self.track_tensor(leaf)
        return out

    def __enter__(self):
        orig, tracker = self._orig_resize, self

        @wraps(orig)
        def resize_(st, size):
            result = orig(st, size)
            if tracker._entries.get(st) is not None:
                tracker._track_storage(st)
            return result

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._orig_resize
        return super().__exit__(*exc)
