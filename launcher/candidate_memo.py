"""Estimated candidates kept on disk, so a plan made before is not estimated again.

A plan's candidates (launcher.planner.evaluate: memory and speed of one strategy, micro-batch
and training variant) are pure functions of the config, the model spec, the cluster, the
installed torch/transformers/peft/numpy (the traces they read) and the launcher's own code. One
file per such context, `<cache dir>/candidates/<context key>.json`, holds the candidates of that
context by (strategy, micro-batch, variant). The context key hashes the whole config (except where
the run is written: run_dir, resume), the spec, the cluster, those versions, the Python version
and the source text of every module of the `launcher` package, so any change of an input or of
the code is another file, never a stale estimate. Values are stored as JSON with their dataclass
types (`_encode`) and kept only when they decode to an equal value; an unreadable file is an
empty memo.
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import os
import sys
from pathlib import Path

from launcher import lengths
from launcher.environment import DEFAULT_CACHE_DIR, installed_version

FORMAT = 1
_CODE_HASH: list[str] = []


def code_hash() -> str:
    """sha256 of the source text of every module of the launcher package (path and text), with
    the C source of its compiled allocator replay (memory/_replay.c)."""
    if not _CODE_HASH:
        root = Path(__file__).resolve().parent
        h = hashlib.sha256()
        for path in sorted([*root.rglob("*.py"), *root.rglob("*.c")]):
            h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
        _CODE_HASH.append(h.hexdigest())
    return _CODE_HASH[0]


def _encode(x):
    """JSON of a value made of dataclasses (of launcher modules), tuples, lists, dicts and exact
    bool/int/float/str/None; anything else raises TypeError."""
    t = type(x)
    if x is None or t in (bool, int, float, str):
        return x
    if dataclasses.is_dataclass(x) and t.__module__.startswith("launcher."):
        return {"dc": f"{t.__module__}:{t.__qualname__}",
                "f": {f.name: _encode(getattr(x, f.name)) for f in dataclasses.fields(x)}}
    if t is tuple:
        return {"t": [_encode(v) for v in x]}
    if t is list:
        return {"l": [_encode(v) for v in x]}
    if t is dict:
        return {"d": [[_encode(k), _encode(v)] for k, v in x.items()]}
    raise TypeError(f"not stored: {t.__name__}")


def _decode(x):
    if not isinstance(x, dict):
        return x
    if "dc" in x:
        module, _, name = x["dc"].partition(":")
        if not module.startswith("launcher."):
            raise ValueError(module)
        cls = getattr(importlib.import_module(module), name)
        return cls(**{k: _decode(v) for k, v in x["f"].items()})
    if "t" in x:
        return tuple(_decode(v) for v in x["t"])
    if "l" in x:
        return [_decode(v) for v in x["l"]]
    return {_decode(k): _decode(v) for k, v in x["d"]}


def context_key(config, spec, cluster) -> str:
    """The hash of everything a candidate's estimate depends on besides its own strategy,
    micro-batch and variant (module docstring)."""
    cfg = dataclasses.asdict(config)
    cfg.pop("run_dir", None), cfg.pop("resume", None)
    profile = config.training.length_profile  # a path's content may change under the same name
    profile = dataclasses.asdict(lengths.load(profile)) if profile else None
    blob = json.dumps([FORMAT, code_hash(), sys.version, [installed_version(d) for d in
                                                           ("torch", "transformers", "peft", "numpy")],
                       cfg, dataclasses.asdict(spec), dataclasses.asdict(cluster), profile],
                      sort_keys=True, default=repr)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


class CandidateMemo:
    def __init__(self, config, spec, cluster):
        root = Path(config.cache_dir).expanduser() if config.cache_dir else DEFAULT_CACHE_DIR
        self.path = root / "candidates" / f"{context_key(config, spec, cluster)}.json"
        self._values: dict | None = None
        self._new = False

    def _load(self) -> dict:
        if self._values is None:
            try:
                data = json.loads(self.path.read_text())
                self._values = data if isinstance(data, dict) else {}
            except (OSError, ValueError):
                self._values = {}
        return self._values

    @staticmethod
    def _key(strategy, micro: int, variant) -> str | None:
        try:
            return json.dumps(_encode((strategy, micro, variant)), sort_keys=True)
        except TypeError:
            return None

    def get(self, strategy, micro: int, variant):
        """(Candidate, numbers) of an earlier evaluation, or None."""
        key = self._key(strategy, micro, variant)
        stored = self._load().get(key) if key is not None else None
        if stored is None:
            return None
        try:
            return _decode(stored)
        except (ValueError, TypeError, KeyError, AttributeError, ImportError):
            return None

    def put(self, strategy, micro: int, variant, result) -> None:
        key = self._key(strategy, micro, variant)
        if key is None:
            return
        try:
            encoded = _encode(result)
            if _decode(json.loads(json.dumps(encoded))) != result:
                return
        except (TypeError, ValueError):
            return
        self._load()[key] = encoded
        self._new = True

    def save(self) -> None:
        """Write the file when something was added; a read-only cache only costs time."""
        if not self._new:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(self._values, separators=(",", ":")))
            os.replace(tmp, self.path)
        except OSError:
            return
        self._new = False
