"""The training loop of one rank: validate inputs, join the process group, build, train,
measure, checkpoint, report. Everything that can be wrong with the user's input is checked
before the process group exists, so a bad input fails fast with one line on every rank."""
from __future__ import annotations

import os
import random
import socket
import sys
import time
import warnings
from dataclasses import asdict, dataclass

from launcher.backends import registry
from launcher.errors import ConfigError
from launcher.worker import checkpoint, layout, metrics, oom, stop
from launcher.worker.backends import check_backend, make_backend, moves_model
from launcher.worker.data import (PackedDataset, load_dataset, micro_batch_positions, read_documents,
                                  samples_per_step)
from launcher.worker.memory import MemoryMeter
from launcher.worker.model import (PrecisionPlan, build_model, check_seq_len, load_config, param_bytes,
                                   precision_plan)
from launcher.worker.tokenizer import check_vocab, load_tokenizer


@dataclass(frozen=True)
class RankEnv:
    rank: int
    world_size: int
    local_rank: int
    device: str  # 'cpu' | 'cuda'

    def torch_device(self):
        """This rank's torch device: its local GPU, or the CPU."""
        import torch

        return torch.device("cuda", self.local_rank) if self.device == "cuda" else torch.device("cpu")


@dataclass
class Inputs:
    config: object
    tokenizer: object
    plan: PrecisionPlan


def _check_numbers(spec) -> None:
    problems = [f"{name}={getattr(spec, name)} must be >= {low}"
                for name, low in (("seq_len", 1), ("micro_batch_size", 1), ("grad_accum_steps", 1),
                                  ("max_steps", 1), ("log_every", 1))
                if getattr(spec, name) < low]
    if spec.device not in ("cpu", "cuda"):
        problems.append(f"device={spec.device!r} is not 'cpu' or 'cuda'")
    if problems:
        raise ConfigError(*problems)


def validate(spec) -> Inputs:
    """Every input check that needs no process group: numbers, backend, precision, model config,
    seq_len against the model's positions, tokenizer against the model's vocabulary."""
    _check_numbers(spec)
    check_backend(spec, int(os.environ.get("WORLD_SIZE", "1")))
    plan = precision_plan(spec.precision, spec.backend, spec.device)
    config = load_config(spec)
    check_seq_len(config, spec.seq_len)
    tokenizer = load_tokenizer(spec.tokenizer_path, spec.init, spec.trust_remote_code)
    check_vocab(tokenizer, config.vocab_size)
    return Inputs(config, tokenizer, plan)


def check(spec) -> None:
    """`--check`: validate inputs and that the dataset has usable text; no training."""
    validate(spec)
    read_documents(spec.data_path, spec.text_key)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rank_env(spec) -> RankEnv:
    """torchrun's RANK / WORLD_SIZE / LOCAL_RANK; a plain `python -m launcher.worker` is rank 0 of 1."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
    return RankEnv(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]),
                   int(os.environ.get("LOCAL_RANK", "0")), spec.device)


def init_distributed(spec, env: RankEnv) -> None:
    """gloo on CPU, nccl on CUDA, joined the way the backend's framework joins (its `join` hook,
    launcher/backends/base.py), else through torch's `init_process_group`."""
    import torch
    import torch.distributed as dist

    if env.device == "cuda":
        torch.cuda.set_device(env.local_rank)
    join = registry.get(spec.backend).join
    if join:
        registry.load(join)(spec.seed, env.device)
    else:
        dist.init_process_group("nccl" if env.device == "cuda" else "gloo")


def seed_everything(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % 2 ** 32)
    torch.manual_seed(seed)


def _quiet_library_warnings() -> None:
    """DeepSpeed calls torch collectives torch has renamed; the FutureWarning repeats every step."""
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)


def run(spec) -> None:
    _quiet_library_warnings()
    inputs = validate(spec)
    dataset = load_dataset(spec.data_path, spec.text_key, inputs.tokenizer, spec.seq_len, spec.seed)
    env = rank_env(spec)
    restart_count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    oom.exit_if_oom_before_restart(spec, env.rank, restart_count)
    resume_dir = _resume_dir(spec, restart_count, env.rank == 0)
    stop.install_handlers()
    init_distributed(spec, env)
    import torch.distributed as dist

    progress = oom.Progress()
    try:
        stopped = train(spec, env, inputs, dataset, resume_dir, progress)
    except checkpoint.DiskFullError as err:
        print(f"error: {err.strerror}", file=sys.stderr, flush=True)
        sys.stderr.flush()
        os._exit(checkpoint.DISK_FULL_EXIT_CODE)
    except Exception as err:
        if oom.is_oom(err):
            oom.exit_after_oom(spec, env.rank, env.device, progress, err)
        raise
    finally:
        dist.destroy_process_group()
    if stopped:
        sys.stdout.flush()
        os._exit(stop.STOPPED_EXIT_CODE)
    # ColossalAI, DeepSpeed and torch's own pools leave joinable C++ threads behind: interpreter
    # teardown then intermittently aborts ("terminate called without an active exception") after
    # a finished run, which torchrun reports as a failed rank. Every file is written and closed
    # by now, so leave without the teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _resume_dir(spec, restart_count: int, warn: bool):
    """resume=true: the newest complete checkpoint of this run directory; resume=<checkpoint>
    (the fallback's next attempt): that one until this attempt has saved its own. After an
    elastic restart (torchrun --max-restarts) the newest complete checkpoint is taken."""
    if isinstance(spec.resume, str):
        own = checkpoint.find_resume_dir(spec.run_dir, True, warn=False) if restart_count > 0 else None
        return own or checkpoint.find_resume_dir(spec.run_dir, spec.resume, warn)
    return checkpoint.find_resume_dir(spec.run_dir, spec.resume or restart_count > 0, warn)


def _gather(obj) -> list:
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _mean_loss_and_stop(losses: list) -> tuple[float, bool]:
    """The loss averaged over ranks, and whether any rank was asked to stop (launcher/worker/stop.py):
    one all-reduce, so every rank stops after the same step."""
    import torch
    import torch.distributed as dist

    values = torch.stack([torch.stack(losses).mean().float(), torch.tensor(float(stop.requested()))])
    dist.all_reduce(values)
    return float(values[0]) / dist.get_world_size(), bool(values[1] > 0)


def train(spec, env: RankEnv, inputs: Inputs, dataset: PackedDataset, resume_dir,
          progress: oom.Progress | None = None) -> bool:
    """Train to spec.max_steps; True when stopped early on a signal (after a checkpoint)."""
    import torch

    seed_everything(spec.seed)  # identical initial weights on every rank
    device = env.torch_device()
    own_layout = layout.layout_of(spec, env.world_size)
    saved_layout = layout.read_layout(resume_dir) if resume_dir is not None else None
    neutral = resume_dir is not None and not layout.same_layout(saved_layout, own_layout)
    if neutral and not layout.is_neutral(saved_layout):
        raise ConfigError(f"checkpoint {resume_dir} was written by {saved_layout['strategy']} on "
                          f"{saved_layout['world_size']} ranks; convert it first (launcher/worker/layout.py to_neutral)")
    with MemoryMeter(env.device, spec.measure_memory) as meter:
        with meter.phase("setup"):
            model = build_model(spec, inputs.config, inputs.plan)
            if not moves_model(spec):
                model = model.to(device)
            if neutral:
                layout.load_neutral_weights(model, resume_dir)
            num_param_bytes = param_bytes(model)
            backend = make_backend(model, spec, env, inputs.plan, meter)
        meter.take_step()
        seed_everything(spec.seed + env.rank)  # per-rank dropout streams
        state = checkpoint.TrainerState(0, 0, env.world_size)
        if resume_dir is not None:
            if neutral:
                backend.load_neutral(resume_dir)
                checkpoint.restore_rng(resume_dir, env.rank)
                state = checkpoint.TrainerState.read(resume_dir)
            else:
                state = checkpoint.load(backend, resume_dir, env.rank)
            if env.rank == 0:
                how = f" (layout {saved_layout.get('strategy')} -> {spec.strategy})" if neutral else ""
                print(f"resumed from {resume_dir} at step {state.step}{how}", flush=True)
        records, stopped = _loop(spec, env, backend, dataset, meter, state, device, progress or oom.Progress())
        overall = _gather(asdict(meter.overall) if meter.overall else None)
    if env.rank == 0 and not stopped:
        summary = metrics.build_summary(records, overall, spec.estimate, env.world_size)
        summary["param_bytes"] = num_param_bytes
        if resume_dir is not None:
            summary["resumed_from"] = {"checkpoint": str(resume_dir), "step": state.step,
                                       "layout": saved_layout, "optimizer_state": "restored"}
        metrics.write_summary(spec.run_dir, summary)
        print(metrics.summary_table(summary), flush=True)
    return stopped


def _loop(spec, env, backend, dataset, meter, state, device, progress: oom.Progress) -> tuple[list[dict], bool]:
    import torch

    step_samples = samples_per_step(env.world_size, spec.micro_batch_size, spec.grad_accum_steps)
    position, records = state.data_position, progress.records
    for step in range(state.step + 1, spec.max_steps + 1):
        progress.step = step
        lr = backend.lr
        start_s = time.perf_counter()
        losses, block_ids = [], []
        for micro in range(spec.grad_accum_steps):
            positions = micro_batch_positions(position, micro, env.rank, env.world_size, spec.micro_batch_size)
            input_ids, index = dataset.batch(positions)
            block_ids += index
            losses.append(backend.micro_step(input_ids.to(device), micro == spec.grad_accum_steps - 1))
        backend.optimizer_step()
        if env.device == "cuda":
            torch.cuda.synchronize()
        step_s = time.perf_counter() - start_s
        peak = meter.take_step()
        oom.check_simulated(peak, progress)
        loss, stopping = _mean_loss_and_stop(losses)
        record = _record(step, position, step_samples, spec, lr, step_s, loss, _gather((block_ids, _peak_dict(peak))))
        position += step_samples
        records.append(record)
        if env.rank == 0:
            metrics.append_metrics(spec.run_dir, record)
            if step % spec.log_every == 0 or step == spec.max_steps:
                print(metrics.live_line(record, spec.max_steps), flush=True)
        if (spec.checkpoint_every > 0 and step % spec.checkpoint_every == 0) or step == spec.max_steps or stopping:
            saved = checkpoint.save(backend, spec.run_dir, checkpoint.TrainerState(step, position, env.world_size),
                                    env.rank, env.device, spec.checkpoint_keep, layout.layout_of(spec, env.world_size))
        if stopping and step < spec.max_steps:
            if env.rank == 0:
                stop.write_marker(spec.run_dir, step, saved)
            return records, True
    return records, False


def _peak_dict(peak) -> dict | None:
    return asdict(peak) if peak is not None else None


def _record(step, position, step_samples, spec, lr, step_s, loss, gathered) -> dict:
    record = {
        "step": step, "loss": loss, "lr": lr, "step_s": step_s,
        "tokens_per_s": step_samples * spec.seq_len / step_s,
        "data_positions": [position, position + step_samples],
        "block_ids": [ids for ids, _ in gathered],
    }
    peaks = [peak for _, peak in gathered]
    if all(p is not None for p in peaks):
        record["peak_allocated_bytes"] = [p["allocated_bytes"] for p in peaks]
        record["peak_phase"] = [p["phase"] for p in peaks]
        if peaks[0]["reserved_bytes"] is not None:
            record["peak_reserved_bytes"] = [p["reserved_bytes"] for p in peaks]
    return record
