"""Process-group set-up for the DeepSpeed launcher (N ranks) and for a plain single process."""
from __future__ import annotations

import os
from typing import NoReturn

import torch
import torch.distributed as dist

from ..process.command_lines import free_port
from ..errors import RuntimeSetupError
from .patches_deepspeed import skip_cpu_shm_build


def init() -> tuple[int, int, int]:
    """Start the process group (nccl on GPUs, gloo on CPU ranks); returns (rank, world, local_rank)."""
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(free_port())
    local_rank = int(os.environ["LOCAL_RANK"])
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    cuda = torch.cuda.is_available()
    if cuda:
        count = torch.cuda.device_count()
        if local_rank >= count:   # CUDA's own error here ("invalid device ordinal") names neither cause nor fix
            raise RuntimeSetupError(
                f"rank {local_rank} of this machine has no GPU: {local_world} ranks were started here, but this "
                f"machine shows {count} GPU(s). Start at most {count} (deepspeed --num_gpus, the Parallelism "
                "node's gpus), with pipeline_stages dividing that number")
        torch.cuda.set_device(local_rank)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local_world)))
    if not dist.is_initialized():
        import deepspeed
        if not cuda:
            skip_cpu_shm_build()
        deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo", auto_mpi_discovery=False)
    return dist.get_rank(), dist.get_world_size(), local_rank


def finish() -> None:
    """The run is over on this rank: wait for the others, so that nothing of theirs is still in flight to this one
    when its process ends (``end_process``)."""
    barrier()


def end_process(code: int) -> NoReturn:
    """Where a rank's process ends after a successful run: the interpreter's exit work that matters runs (atexit
    handlers: logging, TensorBoard, W&B; the standard streams), then the process exits without the interpreter's
    teardown. In that teardown the native threads of gloo and of the process group's store can abort a finished rank
    (SIGABRT, "terminate called without an active exception"), which DeepSpeed's launcher reports as a failed run."""
    import atexit
    import sys

    try:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def started() -> bool:
    return dist.is_initialized()


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def broadcast_object(obj, src: int = 0):
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_gather_object(obj) -> list:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


# A rank that fails for a reason of its own (a full disk, a bad file) leaves its one-line reason in the process
# group's key-value store, which global rank 0 hosts: rank 0 then reports that reason rather than only losing
# contact with the rank. The store is torch's private default one; without it, rank 0 reports the lost contact.
_FAILURE_KEY = "pipetrain-failure-{}"


def _store():
    try:
        return dist.distributed_c10d._get_default_store() if dist.is_initialized() else None
    except (AttributeError, RuntimeError, ValueError):
        return None


def tell_failure(message: str) -> None:
    store = _store()
    if store is None:
        return
    try:
        store.set(_FAILURE_KEY.format(dist.get_rank()), message)
    except (RuntimeError, OSError):   # rank 0 (the store's host) has gone: nobody left to tell
        pass


def peer_failure() -> tuple[int, str] | None:
    """(rank, reason) of the first other rank that told its failure, else None."""
    store = _store()
    if store is None:
        return None
    try:
        for rank in range(dist.get_world_size()):
            key = _FAILURE_KEY.format(rank)
            if rank != dist.get_rank() and store.check([key]):
                return rank, store.get(key).decode()
    except (RuntimeError, OSError):
        return None
    return None
