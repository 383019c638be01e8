"""The one module that decides devices and process-group backends.

Every other module asks this one; none names a device type ("cpu", "cuda", "neuron") or a backend ("gloo",
"nccl") itself (tests/test_device.py checks the source). Everything goes through `torch.accelerator` and the
device-type-generic APIs (`torch.get_device_module`, `torch.autocast(device_type=...)`), so a new accelerator
that registers itself with torch (TorchNeuron registers `neuron` through PrivateUse1, Intel `xpu`, ...) runs
unchanged: `train.device = auto | cpu | <the accelerator type torch reports>`.

What torch reports is passed in as an `Accelerator` value (detected by `Accelerator.detect()`), so the
selection rules are plain functions that tests drive with a fake accelerator, without the hardware.

Torch is imported inside functions: the config schema imports this module and stays torch-free.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

AUTO = "auto"
CPU = "cpu"  # the host: also where checkpoints are staged and gloo side-groups run
CUDA = "cuda"
NEURON = "neuron"  # TorchNeuron (AWS, Trainium2/3): PrivateUse1 device and torch.distributed backend "neuron"
NAMED_DEVICES = (AUTO, CPU, CUDA, NEURON)  # any other torch.accelerator type is accepted too

HOST_BACKEND = "gloo"  # collectives on host tensors (checkpoint coordination, CPU training)
# The backends we choose ourselves; any other device type takes torch's default map
# (torch.distributed.Backend.default_device_backend_map: xpu -> xccl, mps -> gloo, registered backends).
BACKENDS = {CPU: HOST_BACKEND, CUDA: "nccl", NEURON: "neuron"}
BACKEND_NAMES = tuple(sorted(set(BACKENDS.values())))  # e.g. for recognising collectives in profiler traces

_NAME = re.compile(r"[a-z][a-z0-9_]*")
# Out-of-tree backends imported when named explicitly (PyTorch's device-backend autoload usually loads them:
# this covers environments that turn autoload off). TorchNeuron's docs import torch_neuronx before init.
EXTENSIONS = {NEURON: "torch_neuronx"}


def check_device_name(value: str, field: str | None = "train.device") -> str:
    """The config-time check of `train.device` (torch-free): a device *type* name, no index (the rank's
    LOCAL_RANK picks the index). Whether this machine has it is checked by `resolve_device_type`. `field`
    None: the message without the "field=value: " prefix (the config's error formatter adds it)."""
    if not isinstance(value, str) or not _NAME.fullmatch(value):
        prefix = f"{field}={value!r}: " if field else ""
        raise ValueError(f"{prefix}allowed: {', '.join(NAMED_DEVICES)} or another torch accelerator type (a "
                         f"lower-case device type name without an index; LOCAL_RANK picks it)")
    return value


@dataclass(frozen=True)
class Accelerator:
    """What torch reports about this process's accelerator: its device type (None: none) and device count."""

    type: str | None = None
    count: int = 0

    @classmethod
    def detect(cls) -> Accelerator:
        import torch

        acc = torch.accelerator.current_accelerator(check_available=True)
        return cls(acc.type, torch.accelerator.device_count()) if acc is not None else cls()

    def describe(self) -> str:
        return f"{self.count} {self.type} device(s)" if self.type and self.count else "no accelerator"


def known_device_type(name: str) -> bool:
    """Whether torch knows `name` as a device type at all (a typo like 'cdua' does not parse)."""
    import torch

    try:
        torch.device(name)
    except RuntimeError:
        return False
    return True


def resolve_device_type(requested: str, acc: Accelerator, known: Callable[[str], bool] = known_device_type,
                        field: str = "train.device") -> str:
    """The device type this process runs on: auto = the accelerator torch reports (else cpu); an explicit
    type must be the one present. One error names the field, the value, why, and what is allowed here."""
    check_device_name(requested)
    present = acc.type if acc.type and acc.count > 0 else None
    if requested == AUTO:
        return present or CPU
    if requested in (CPU, present):
        return requested
    allowed = ", ".join([AUTO, CPU] + ([present] if present else []))
    if requested not in NAMED_DEVICES and not known(requested):
        why = "not a device type this torch build knows"
    else:
        why = f"not available here (torch sees {acc.describe()})"
        if requested == NEURON:
            why += "; Trainium needs TorchNeuron (torch-neuronx) installed"
    raise ValueError(f"{field}='{requested}': {why}; allowed here: {allowed}")


def device_index(device_type: str, local_rank: int, acc: Accelerator) -> int | None:
    """The accelerator index of this rank (one rank per device: torchrun's LOCAL_RANK), None on the host."""
    if device_type == CPU:
        return None
    if not 0 <= local_rank < acc.count:
        raise ValueError(f"LOCAL_RANK={local_rank} but torch sees {acc.describe()}; allowed: at most "
                         f"{acc.count} ranks per node on {device_type} (--nproc-per-node)")
    return local_rank


def pick_device(requested: str, local_rank: int, acc: Accelerator | None = None) -> torch.device:
    """Resolve `train.device` for this rank and make it the current device."""
    import torch

    if acc is None:
        load_extension(requested)
        acc = Accelerator.detect()
    kind = resolve_device_type(requested, acc)
    index = device_index(kind, local_rank, acc)
    if index is None:
        return torch.device(kind)
    torch.accelerator.set_device_index(index)
    return torch.device(kind, index)


def load_extension(device_type: str) -> None:
    """Import the package that registers `device_type` with torch, if we know one and it is installed (when it
    is not, `resolve_device_type` says the device is not available, naming the package)."""
    import importlib

    if (module := EXTENSIONS.get(device_type)) is not None:
        try:
            importlib.import_module(module)
        except ImportError:
            pass


def backend_for(device_type: str, default_map: Mapping[str, str] | None = None) -> str:
    """The process-group backend for ranks on `device_type`: ours for cpu/cuda/neuron, else torch's map."""
    if device_type in BACKENDS:
        return BACKENDS[device_type]
    if default_map is None:
        import torch.distributed as dist

        default_map = dist.Backend.default_device_backend_map
    if device_type in default_map:
        return default_map[device_type]
    raise ValueError(f"train.device='{device_type}': no torch.distributed backend is registered for it "
                     f"(known: {', '.join(sorted({**default_map, **BACKENDS}))})")


# -- host vs accelerator ------------------------------------------------------------------------------------
def host() -> torch.device:
    import torch

    return torch.device(CPU)


def is_host(device: torch.device | str) -> bool:
    import torch

    return torch.device(device).type == CPU


def available_accelerator(acc: Accelerator | None = None) -> str | None:
    """The accelerator type present on this machine, or None."""
    acc = Accelerator.detect() if acc is None else acc
    return acc.type if acc.type and acc.count > 0 else None


def accelerator_count(acc: Accelerator | None = None) -> int:
    acc = Accelerator.detect() if acc is None else acc
    return acc.count if acc.type else 0


def pin_memory() -> bool:
    """Page-locked host staging buffers help only when an accelerator copies from them."""
    import torch

    return torch.accelerator.is_available()


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of `t` in host memory (activation offloading, parallel/offload.py): page-locked where an accelerator
    copies into it, so the copy out is queued behind the device's work instead of making the host wait for it
    (the device tensor's memory is reused only by work queued after the copy); on the host a plain copy."""
    import torch

    pinned = not is_host(t.device) and pin_memory()
    out = torch.empty_like(t, device=CPU, pin_memory=pinned)
    return out.copy_(t, non_blocking=pinned)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A batch tensor on the compute device without making the host wait: host to accelerator copies go from
    page-locked memory and do not block (a pageable source is pinned first; pinning is a host copy, no device
    wait). On the host, or already there: the tensor itself."""
    if t.device == device or (is_host(device) and is_host(t.device)):
        return t
    if is_host(t.device) and not t.is_pinned():
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


# -- synchronisation, memory, numerics ------------------------------------------------------------------------
def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (timing); a no-op on the host, where work is synchronous."""
    import torch

    host_syncs_counted()  # visible to an active SyncCounter, on any device
    if not is_host(device):
        torch.accelerator.synchronize(device)


def sync_fn(device: torch.device) -> Callable[[], None] | None:
    """A zero-argument synchronise for timers, or None where nothing needs waiting for (the host)."""
    return None if is_host(device) else (lambda: synchronize(device))


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this process: the allocator's peak on an accelerator, peak resident set on the host."""
    if is_host(device):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # ru_maxrss is KiB on Linux
    import torch

    return int(torch.accelerator.max_memory_allocated(device))


def reset_peak_memory(device: torch.device) -> None:
    import torch

    if not is_host(device):
        torch.accelerator.reset_peak_memory_stats(device)


def memory_stats(device: torch.device) -> dict:
    """Allocated / reserved / peak bytes on an accelerator; peak RSS on the host."""
    import torch

    if is_host(device):
        return {"peak_bytes": peak_memory_bytes(device)}
    return {"allocated_bytes": int(torch.accelerator.memory_allocated(device)),
            "reserved_bytes": int(torch.accelerator.memory_reserved(device)),
            "peak_bytes": peak_memory_bytes(device)}


def matmul_dtype(device: torch.device) -> torch.dtype:
    """The dtype a peak-throughput probe multiplies in: bf16 on accelerators (their datasheet peak), fp32 on
    the host (CPUs without bf16 matrix units run bf16 slower than fp32)."""
    import torch

    return torch.float32 if is_host(device) else torch.bfloat16


def autocast(device: torch.device, dtype: torch.dtype | None):
    """torch.autocast for this device type, or a null context for dtype None (fp32)."""
    import torch

    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=dtype)


# -- RNG ----------------------------------------------------------------------------------------------------
def accelerator_rng_state(acc: Accelerator | None = None) -> dict:
    """{device type: per-device RNG states} of the accelerator present (empty on a host-only machine)."""
    kind = available_accelerator(acc)
    if kind is None:
        return {}
    import torch

    module = torch.get_device_module(kind)
    getter = getattr(module, "get_rng_state_all", None)
    return {kind: getter()} if getter is not None else {}


def set_accelerator_rng_state(state: Mapping, acc: Accelerator | None = None) -> None:
    """Restore what `accelerator_rng_state` saved, if it was saved on the same accelerator type."""
    kind = available_accelerator(acc)
    if kind is None or kind not in state:
        return
    import torch

    setter = getattr(torch.get_device_module(kind), "set_rng_state_all", None)
    if setter is not None:
        setter(state[kind])


# -- host reads without stalls, and a counter of the ones that stall ----------------------------------------
class HostValues:
    """Scalars of a step (loss, gradient norm, ...) copied to host memory without waiting for the device.

    The copy is queued behind the step's work (non-blocking, into pinned memory on an accelerator) and an event
    marks it; `read()` waits for that event only, so reading step N's values once step N+1 is queued does not
    stall the device (the training loop logs each step one step late). On the host the copy is the value."""

    def __init__(self, values: Mapping[str, torch.Tensor], device: torch.device):
        import torch

        self.keys = list(values)
        stacked = torch.stack([v.detach().reshape(()).float() for v in values.values()])
        on_host = is_host(device) or is_host(stacked.device)
        self._host = torch.empty(stacked.shape, dtype=stacked.dtype, pin_memory=not on_host and pin_memory())
        self._host.copy_(stacked, non_blocking=not on_host)
        self._event = None
        if not on_host:
            self._event = torch.Event(device=stacked.device)
            self._event.record(torch.accelerator.current_stream(stacked.device))

    def read(self) -> dict[str, float]:
        if self._event is not None:
            self._event.synchronize()  # waits for this copy only, not for the work queued after it
        return dict(zip(self.keys, self._host.tolist(), strict=True))  # tolist of host memory: no device read


def read_after(works: list, tensor: torch.Tensor, device: torch.device) -> list[float]:
    """The values of `tensor` once the collectives `works` (that write it) completed, without waiting for the
    compute queued since: on an accelerator the wait and the copy to host run on a side stream and only that
    copy's event is waited for; on the host the collectives are waited for and the tensor read."""
    import torch

    if is_host(device):
        for work in works:
            if work is not None:
                work.wait()
        return tensor.tolist()  # host memory: no device read
    side, compute = torch.Stream(device=device), torch.accelerator.current_stream(device)
    side.wait_stream(compute)  # the tensor was written by work queued on the compute stream
    torch.accelerator.set_stream(side)
    try:
        for work in works:
            if work is not None:
                work.wait()  # NCCL: makes the current (side) stream wait, not the compute stream
        staged = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pin_memory())
        staged.copy_(tensor, non_blocking=True)
        tensor.record_stream(side)
        event = side.record_event()
    finally:
        torch.accelerator.set_stream(compute)
    event.synchronize()
    return staged.tolist()


def all_gather_single(output: torch.Tensor, tensor: torch.Tensor, group=None, async_op: bool = False):
    """dist.all_gather_single (torch 2.13's name; all_gather_into_tensor warns there on every new call site), or
    the old name on an older torch (the package accepts torch >= 2.6)."""
    import torch.distributed as dist

    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, tensor, group=group, async_op=async_op)


def reduce_scatter_single(output: torch.Tensor, tensor: torch.Tensor, op=None, group=None, async_op: bool = False):
    """dist.reduce_scatter_single, or reduce_scatter_tensor on an older torch (as all_gather_single)."""
    import torch.distributed as dist

    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return scatter(output, tensor, op=dist.ReduceOp.SUM if op is None else op, group=group, async_op=async_op)


def host_syncs_counted() -> None:
    """Called by `synchronize`: counts an explicit synchronisation on the innermost active sync counter."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    for mode in reversed(_get_current_dispatch_mode_stack()):
        if getattr(mode, "counts_host_syncs", False):
            mode.record("synchronize")
            return


def sync_counter(host_state=()):
    """A context manager (a torch dispatch mode) that counts what makes the host wait for a device, on any device
    (CPU runs included, so the CPU test suite sees the waits an accelerator would have): reads of a value
    (`.item()`, `float()`, `bool()`, `int()`: aten._local_scalar_dense), data-dependent output shapes (nonzero,
    masked_select, unique), blocking copies between host and device, and explicit `synchronize` calls.
    `.count` and `.ops` (what each was) after the block. `host_state`: tensors that live on the host on every
    device by design, whose reads wait for nothing (torch's optimizers keep their `step` counters there unless
    capturable); on a CPU run they look like any other tensor, so they are named. Defined in a function: this
    module stays torch-free."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    aten = torch.ops.aten
    reads = (aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default,
             aten._unique2.default, aten.unique_consecutive.default)

    ignored = {t.untyped_storage().data_ptr() for t in host_state}

    class SyncCounter(TorchDispatchMode):
        counts_host_syncs = True

        def __init__(self):
            super().__init__()
            self.count = 0
            self.ops: list[str] = []

        def record(self, what: str) -> None:
            self.count += 1
            self.ops.append(what)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func in reads:
                if args[0].untyped_storage().data_ptr() not in ignored:
                    self.record(str(func))
            elif func in (aten._to_copy.default, aten.copy_.default) and not kwargs.get("non_blocking", False):
                if func == aten._to_copy.default:
                    src, dst = args[0], kwargs.get("device")
                else:
                    src, dst = args[1], args[0].device
                if isinstance(src, torch.Tensor) and dst is not None and is_host(src.device) != is_host(dst):
                    self.record(f"blocking copy {src.device} -> {dst}")
            return func(*args, **kwargs)

    return SyncCounter()
