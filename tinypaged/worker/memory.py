"""Memory on the device and the host: what is free, what a KV cache may take (vLLM v1's worker measures the
same before its runner allocates: ``gpu_worker.determine_available_memory``).

``memory_snapshot`` is taken before the weights load; ``profile_free_gpu_bytes`` runs the runner's profiling
forward and says what is left for the KV cache; ``check_memory`` refuses, before any allocation, a cache or
swap space larger than the memory there is, naming the knob to lower.
"""

from __future__ import annotations

import os

import torch

from tinypaged.kv.sizing import sizing_knob


def memory_snapshot(device) -> tuple[int, int, int, int] | None:
    """(free, total, torch allocated, torch reserved) bytes on a CUDA ``device``, None elsewhere. Taken
    before the weights load: GPU sizing (``profile_free_gpu_bytes``) counts only what this engine adds
    after it, and vLLM refuses to start when less is free than the share it was given."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return free, total, torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)


def check_memory(c, device, kv_bytes: int, swap_bytes: int) -> None:
    """Refuse, before allocating, a KV cache (or swap space) larger than the memory there is."""
    knob, name = sizing_knob(c, device.type == "cuda")
    host = available_host_bytes()
    device_free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else host
    if device_free is not None and kv_bytes > device_free:
        where = "on the GPU" if device.type == "cuda" else "in this machine's memory (MemAvailable)"
        raise ValueError(f"{knob} asks for a KV cache of {_gib(kv_bytes)}, but only {_gib(device_free)} is "
                         f"free {where}: lower {name}")
    if swap_bytes and host is not None and swap_bytes + (kv_bytes if device.type == "cpu" else 0) > host:
        raise ValueError(f"swap_space={c.swap_space} GiB asks for {_gib(swap_bytes)} of CPU memory beside the KV "
                         f"cache, but only {_gib(host)} is available (MemAvailable): lower swap_space")


def profile_free_gpu_bytes(runner, c, mem_at_start) -> int:
    """vLLM v1's sizing: requested = total x gpu_memory_utilization; KV = requested - (weights +
    activation peak of a max-size forward + memory torch does not track)."""
    # as vLLM: what this engine adds since start-up counts; memory others (or earlier engines in
    # this process) already held only lowers what is free
    free_start, total, allocated_start, reserved_start = mem_at_start
    requested = int(total * c.gpu_memory_utilization)
    if free_start < requested:
        raise ValueError(
            f"Free memory on the device at start-up ({free_start / 2**30:.2f} of {total / 2**30:.2f} GiB) is "
            f"less than the requested share gpu_memory_utilization={c.gpu_memory_utilization} "
            f"({requested / 2**30:.2f} GiB); lower gpu_memory_utilization or free memory used by other processes.")
    peak = runner.profile_peak_bytes(c.max_num_batched_tokens, c.max_model_len, c.max_num_seqs) - allocated_start
    free_now, _ = torch.cuda.mem_get_info(runner.device)
    grown = free_start - free_now  # what this process added on the device since start-up
    non_torch = max(0, grown - (torch.cuda.memory_reserved(runner.device) - reserved_start))
    available = requested - peak - non_torch
    if available <= 0:
        raise ValueError(
            f"No memory is left for the KV cache: weights and activations peak at {peak / 2**30:.2f} GiB "
            f"(+{non_torch / 2**30:.2f} GiB outside torch) of the {requested / 2**30:.2f} GiB allowed; raise "
            f"gpu_memory_utilization or lower max_num_batched_tokens.")
    return available


def available_host_bytes() -> int | None:
    """Memory the machine can still give this process (Linux's MemAvailable), or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"

