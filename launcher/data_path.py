"""Which `data.path` values the worker can read as a dataset, checked before a run is launched
(launcher/validate.py) and again by the worker (launcher/worker/data.py `read_documents`)."""
from __future__ import annotations

from pathlib import Path


def data_path_problem(data_path: str) -> str:
    """Why the worker cannot read `data.path` as a dataset (launcher/worker/data.py
    `read_documents`), or '': it must be a .txt or .jsonl file, or a directory that
    `datasets.save_to_disk` wrote (datasets load_from_disk reads its state.json, or a
    DatasetDict's dataset_dict.json)."""
    fix = "give a .txt, .jsonl, a datasets.save_to_disk directory, or data.path=demo"
    path = Path(data_path).expanduser()
    if data_path == "demo":
        return ""
    if not path.exists():
        return f"data.path={data_path}: no such file or directory; {fix}"
    if path.is_dir():
        if not ((path / "state.json").exists() or (path / "dataset_dict.json").exists()):
            return f"data.path={data_path}: a directory but not a datasets.save_to_disk dataset; {fix}"
        return ""
    if path.suffix not in (".txt", ".jsonl"):
        return f"data.path={data_path}: unsupported file type {path.suffix!r}; {fix}"
    return ""
