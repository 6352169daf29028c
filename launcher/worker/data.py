"""Training data: read texts, tokenize, pack into fixed-length blocks, and hand each rank its
shard of every global batch in a deterministic order.

Order. Sample positions 0, 1, 2, ... index an endless stream; position p lies in epoch
p // num_blocks and maps to `randperm(num_blocks, seed + epoch)[p % num_blocks]`. Optimizer
step s (1-based) consumes positions [(s-1)*S, s*S) with S = world * micro_batch * grad_accum;
within it micro-batch m of rank r takes micro_batch consecutive positions starting at
(m*world + r)*micro_batch, like `torch.utils.data.DistributedSampler` over a global batch.
So the batch of any step is a pure function of (seed, step), and a resumed run continues with
exactly the next batch.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import numpy as np

from launcher.errors import ConfigError
from launcher.data_path import data_path_problem

DEMO_DATASET = "demo"
DEMO_FILE = "demo.txt"


def demo_path() -> Path:
    """The public-domain English corpus shipped in the package (launcher/data/demo.txt)."""
    return Path(__file__).resolve().parent.parent / "data" / DEMO_FILE


def resolve_data_path(data_path: str) -> Path:
    path = demo_path() if data_path == DEMO_DATASET else Path(data_path).expanduser()
    if not path.exists():
        raise ConfigError(f"dataset {data_path} does not exist; set data_path to a .txt, .jsonl, "
                          f"a datasets.save_to_disk directory, or 'demo'")
    return path


def _txt_documents(path: Path) -> Iterator[str]:
    """Paragraphs (blank-line separated) of a plain text file, one document each."""
    paragraph: list[str] = []
    with path.open(encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.strip():
                paragraph.append(line.rstrip("\n"))
            elif paragraph:
                yield "\n".join(paragraph)
                paragraph = []
    if paragraph:
        yield "\n".join(paragraph)


def _jsonl_documents(path: Path, text_key: str) -> Iterator[str]:
    with path.open(encoding="utf-8") as f:
        for num, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ConfigError(f"{path}:{num} is not valid JSON ({err.msg})") from None
            value = record.get(text_key) if isinstance(record, dict) else None
            if isinstance(value, str):
                yield value


def _saved_dataset_documents(path: Path, text_key: str) -> Iterator[str]:
    import datasets

    try:
        data = datasets.load_from_disk(str(path))
    except FileNotFoundError:
        raise ConfigError(f"{path} is a directory but not a datasets.save_to_disk dataset") from None
    if isinstance(data, datasets.DatasetDict):
        split = "train" if "train" in data else next(iter(data))
        data = data[split]
    if text_key not in data.column_names:
        raise ConfigError(f"dataset {path} has no column {text_key!r} (columns: "
                          f"{', '.join(data.column_names)}); set text_key")
    for value in data[text_key]:
        if isinstance(value, str):
            yield value


def read_documents(data_path: str, text_key: str) -> list[str]:
    """Non-blank documents of a .txt / .jsonl file or a saved HF dataset directory (the kinds
    launcher/data_path.py accepts, checked again here for a run.json written by hand)."""
    path = resolve_data_path(data_path)
    problem = data_path_problem(str(path))
    if problem:
        raise ConfigError(problem)
    if path.is_dir():
        docs = _saved_dataset_documents(path, text_key)
    elif path.suffix == ".jsonl":
        docs = _jsonl_documents(path, text_key)
    else:
        docs = _txt_documents(path)
    documents = [d for d in docs if d.strip()]
    if not documents:
        raise ConfigError(f"dataset {data_path} contains no usable text"
                          + (f" (field {text_key!r})" if path.suffix == ".jsonl" else ""))
    return documents


def pack_blocks(token_lists: list[list[int]], eos_token_id: int | None, seq_len: int) -> np.ndarray:
    """Concatenate documents (each followed by eos when the tokenizer has one) and cut the
    stream into int64 blocks of seq_len tokens, dropping the incomplete tail: [num_blocks, seq_len]."""
    suffix = [] if eos_token_id is None else [eos_token_id]
    stream = np.fromiter((t for ids in token_lists for t in (*ids, *suffix)), dtype=np.int64)
    num_blocks = len(stream) // seq_len
    return stream[: num_blocks * seq_len].reshape(num_blocks, seq_len)


class SampleOrder:
    """Maps a global sample position to a block index (see the module docstring)."""

    def __init__(self, num_blocks: int, seed: int) -> None:
        self.num_blocks = num_blocks
        self.seed = seed
        self._epoch = -1
        self._perm: np.ndarray | None = None

    def block_index(self, position: int) -> int:
        epoch, offset = divmod(position, self.num_blocks)
        if epoch != self._epoch:
            import torch

            gen = torch.Generator().manual_seed(self.seed + epoch)
            # kept as a numpy copy: the sampler's order lives in host memory, not in a torch
            # storage that the worker's allocation tracker would count as training memory
            self._perm = torch.randperm(self.num_blocks, generator=gen).numpy().copy()
            self._epoch = epoch
        return int(self._perm[offset])


def micro_batch_positions(step_start: int, micro_index: int, rank: int, world_size: int,
                          micro_batch_size: int) -> list[int]:
    """Positions read by `rank` for micro-batch `micro_index` of the step starting at `step_start`."""
    first = step_start + (micro_index * world_size + rank) * micro_batch_size
    return list(range(first, first + micro_batch_size))


def samples_per_step(world_size: int, micro_batch_size: int, grad_accum_steps: int) -> int:
    return world_size * micro_batch_size * grad_accum_steps


class PackedDataset:
    """Packed token blocks plus their deterministic order; `batch(positions)` -> (ids, block ids)."""

    def __init__(self, blocks: np.ndarray, seed: int) -> None:
        self.blocks = blocks
        self.order = SampleOrder(len(blocks), seed)

    def batch(self, positions: list[int]):
        import torch

        index = [self.order.block_index(p) for p in positions]
        return torch.from_numpy(self.blocks[index].copy()), index


def load_dataset(data_path: str, text_key: str, tokenizer, seq_len: int, seed: int) -> PackedDataset:
    documents = read_documents(data_path, text_key)
    blocks = pack_blocks(tokenizer.encode_batch(documents), tokenizer.eos_token_id, seq_len)
    if len(blocks) == 0:
        raise ConfigError(f"dataset {data_path} has fewer tokens than one sequence of "
                          f"seq_len={seq_len}; use more text or a smaller seq_len")
    return PackedDataset(blocks, seed)
