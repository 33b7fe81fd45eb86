"""Where a run executes: its device and, when launched by `torchrun`, its place in the process
group (gloo on CPU, nccl on CUDA), with the few collective operations training needs.

In one process every helper here is a plain pass-through, so the training code reads the same
for one process or many.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset, Subset

from vit_hub.train.settings import TrainingError

T = TypeVar("T")


@dataclasses.dataclass
class Runtime:
    """This process's device, its rank among `world_size` processes, and how many of those
    share its machine (`local_world_size`, which split its cores)."""

    device: torch.device
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    threads: str = ""  # on the CPU: the intra-op threads chosen and why (`choose_cpu_threads`), for the log

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def start_runtime(device: str) -> Runtime:
    """Pick the device; join the process group when launched by torchrun."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise TrainingError("--device cuda: expected a CUDA GPU, found none")
    if device.startswith("cuda:") and int(device[5:]) >= torch.cuda.device_count():
        raise TrainingError(f"--device {device}: expected a GPU index below {torch.cuda.device_count()}, "
                            f"found {torch.cuda.device_count()} GPU(s)")
    if device == "cuda":
        device = f"cuda:{local_rank}"
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True  # TF32 on Ampere and newer
        torch.backends.cudnn.allow_tf32 = True
    runtime = Runtime(torch.device(device), int(os.environ.get("RANK", "0")), world_size, local_rank,
                      local_world_size)
    if runtime.distributed and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if runtime.device.type == "cuda" else "gloo")
    return runtime


def choose_cpu_threads(runtime: Runtime, workers: int) -> None:
    """On the CPU, this process's intra-op threads: the free cores (`free_cores`) shared by the
    processes on this machine, less this process's loader workers, which need cores of their
    own; at least one. More threads than free cores spin against each other and against other
    work: on the busy 2-core development machine one thread trained 311 img/s, two 80-119
    (BENCHMARKS.md, "Where a CPU step's time goes"). OMP_NUM_THREADS, when set, decides instead.
    What was chosen is kept in `runtime.threads` for the log."""
    if runtime.device.type != "cpu":
        return
    if os.environ.get("OMP_NUM_THREADS"):
        runtime.threads = f"{torch.get_num_threads()} intra-op thread(s) per process (OMP_NUM_THREADS)"
        return
    cores, free = free_cores()
    threads = max(1, free // runtime.local_world_size - workers)
    torch.set_num_threads(threads)
    runtime.threads = (f"{threads} intra-op thread(s) per process ({free} of {cores} cores free by the load average, "
                       f"less {workers} loader worker(s); OMP_NUM_THREADS overrides)")


def free_cores() -> tuple[int, int]:
    """(the cores this process may run on, those of them not busy with other work by the
    1-minute load average), the second at least 1."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    return cores, max(1, cores - int(load))


def stop_runtime(runtime: Runtime) -> None:
    """Leave the process group (a no-op in one process)."""
    if runtime.distributed and dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def running(device: str) -> Iterator[Runtime]:
    """`start_runtime(device)` for the length of a `with` block; the process group is left
    however the block ends (a failed set-up included)."""
    runtime = start_runtime(device)
    try:
        yield runtime
    finally:
        stop_runtime(runtime)


def all_reduce(tensor: torch.Tensor, runtime: Runtime) -> torch.Tensor:
    """`tensor` summed over every process, in place."""
    if runtime.distributed:
        dist.all_reduce(tensor)
    return tensor


def from_main(runtime: Runtime, make: Callable[[], T]) -> T:
    """`make()` on rank 0, its result (or its error) sent to every process; just `make()` in one
    process. For work every process needs but only one should do (listing a folder)."""
    if not runtime.distributed:
        return make()
    payload: list[Any] = [None]
    if runtime.is_main:
        try:
            payload[0] = (True, make())
        except Exception as error:  # every process fails with rank 0's one-line error
            payload[0] = (False, error)
    dist.broadcast_object_list(payload, src=0)
    ok, value = payload[0]
    if not ok:
        raise value
    return value


def union_of_all(items: set[str], runtime: Runtime) -> set[str]:
    """The union of every process's `items` (each process's own set in one process)."""
    if not runtime.distributed:
        return set(items)
    everyone: list[Any] = [None] * runtime.world_size
    dist.all_gather_object(everyone, items)
    return set().union(*everyone)


def barrier(runtime: Runtime) -> None:
    """Wait until every process gets here (a no-op in one process)."""
    if runtime.distributed:
        dist.barrier()


def shard(dataset: Dataset, runtime: Runtime) -> Dataset:
    """This process's disjoint slice of `dataset` (no padding): evaluated apart, results summed."""
    if not runtime.distributed:
        return dataset
    return Subset(dataset, range(runtime.rank, len(dataset), runtime.world_size))


def across_processes(network: nn.Module, runtime: Runtime) -> nn.Module:
    """`network` wrapped in DistributedDataParallel (gradients averaged over processes), or
    itself in one process."""
    if not runtime.distributed:
        return network
    device_ids = [runtime.device.index] if runtime.device.type == "cuda" else None
    return DistributedDataParallel(network, device_ids=device_ids)
