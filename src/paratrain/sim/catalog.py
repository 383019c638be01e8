"""Fill the simulator's plain inputs from the hardware catalog (`paratrain.hardware`) and the planner
(`paratrain.plan`). Both are imported lazily: the simulator itself never needs them.

A simulator "device" is an accelerator package that fails as a unit (a GPU, a Trainium chip), because the
failure rates are per GPU-hour (Llama 3). The catalog counts logical devices (Trainium: NeuronCores, 4 per
Trn2 chip), so the bridge converts: devices here = chips, devices per node = chips per node, price per
device-hour = node price / chips per node.
"""

from __future__ import annotations

from importlib import import_module

# Mixed-precision Adam checkpoint: bf16 weights (2) + fp32 master weights (4) + Adam m and v (4 + 4) bytes per
# parameter. Frameworks that do not save the bf16 copy write 12; this is the usual upper figure.
CHECKPOINT_BYTES_PER_PARAM = 14
DEFAULT_SEQ = 4096
DEFAULT_GLOBAL_BATCH = 1024  # sequences: 4M tokens at seq 4096, Llama-3-like


def fill_from_catalog(*, hardware: str | None, model: str | None, devices: int | None, seq: int | None = None,
                      global_batch: int | None = None, purchase: str = "on-demand") -> dict:
    """SimConfig keyword arguments (plus 'notes', naming each number's source) from the catalog and planner;
    the price is the catalog's at `purchase` (on-demand, capacity-block, savings-1y, savings-3y, spot)."""
    if model and not hardware:
        raise ValueError("--model needs --hardware (the planner estimates the step time on a catalog system)")
    system = _system(hardware)
    chips_per_node = system.chips_per_node
    chips_per_host, hosts_per_unit = hosts_of(system)
    out: dict = {"devices_per_node": chips_per_host, "nodes_per_domain": hosts_per_unit}
    notes = [f"devices are {system.chip.name} chips ({system.name}: {system.source})", _unit_note(system)]
    if devices is not None and devices % chips_per_node:
        raise ValueError(f"--devices={devices} is not a whole number of {system.name} units of {chips_per_node} "
                         f"chips: allowed: a multiple of {chips_per_node}")
    quote = system.prices.quote(purchase)
    if quote is not None:
        out["price_per_device_hour_usd"] = quote.usd_per_node_hour / chips_per_node
        notes.append(f"price {quote.usd_per_node_hour:.2f} USD per node-hour ({quote.label()}) / {chips_per_node} "
                     f"chips ({quote.source})")
    else:
        notes.append(f"no {purchase} price for {system.name} in the catalog ({system.prices.source}): give "
                     "--price-per-device-hour-usd for cost outputs")
    if model:
        out.update(_from_planner(system, model, devices, seq or DEFAULT_SEQ, global_batch or DEFAULT_GLOBAL_BATCH,
                                 notes))
    out["notes"] = tuple(notes)
    return out


# The tier that marks a catalog "node" made of several instances (hosts): a Trn2 UltraServer is 4 trn2.48xlarge
# instances joined by NeuronLink, described by the catalog as one 64-chip system with an "intra-instance" tier.
INSTANCE_TIER = "intra-instance"


def hosts_of(system) -> tuple[int, int]:
    """(chips per host, hosts per replacement unit) of a catalog system.

    A catalog node is the unit that is rented. When it is an UltraServer of several instances, the simulator's
    node is the instance (a host fails as a unit: its power supply, NIC, host memory) and the replacement unit
    is the whole UltraServer: the job's layout spans its NeuronLink domain, so a failed host is replaced by a
    spare UltraServer (or waits for its repair), not by a lone instance outside the domain."""
    instance = next((t for t in system.tiers if t.name == INSTANCE_TIER), None)
    if instance is None or not 0 < instance.domain_devices < system.devices_per_node:
        return system.chips_per_node, 1
    if system.devices_per_node % instance.domain_devices or instance.domain_devices % system.devices_per_chip:
        raise ValueError(f"{system.name}: tier {INSTANCE_TIER!r} of {instance.domain_devices} devices does not "
                         f"divide the node's {system.devices_per_node} devices into whole chips")
    return instance.domain_devices // system.devices_per_chip, system.devices_per_node // instance.domain_devices


def _unit_note(system) -> str:
    chips_per_host, hosts = hosts_of(system)
    if hosts > 1:
        return (f"node = one instance of {chips_per_host} chips; replacement unit = one {system.display_name}, "
                f"{hosts} instances ({system.chips_per_node} chips): a failed host takes its NeuronLink domain "
                "out, so a spare is a whole unit")
    return f"node = one {system.display_name}: {system.chips_per_node} chips, replaced as a unit"


def _system(name: str | None):
    if not name:
        raise ValueError("--hardware is required to use the catalog")
    try:
        hardware = import_module("paratrain.hardware.catalog")
    except ModuleNotFoundError:
        raise ValueError("--hardware needs paratrain.hardware, which is not installed; give --devices-per-node "
                         "and --price-per-device-hour-usd instead") from None
    return hardware.resolve_system(name)


def _from_planner(system, model_name: str, devices: int | None, seq: int, global_batch: int, notes: list) -> dict:
    if not devices:
        raise ValueError("--model needs --devices (chips in the job) to plan the step time")
    if devices % system.chips_per_node:
        raise ValueError(f"devices={devices} is not a whole number of {system.name} nodes "
                         f"({system.chips_per_node} chips each)")
    try:
        plan = import_module("paratrain.plan.api")
        model_config = import_module("paratrain.model.config")
    except ModuleNotFoundError:
        raise ValueError("--model needs paratrain.plan, which is not installed; give --step-time and "
                         "--checkpoint-gb instead") from None
    model = model_config.load_model_config(model_name)
    nodes = devices // system.chips_per_node
    result = plan.search(model, system, nodes, seq, global_batch, top=1)
    if not result.candidates:
        raise ValueError(f"the planner found no layout of {model.name} on {nodes} x {system.name} that fits in "
                         f"memory at seq {seq}, global batch {global_batch}")
    best = result.candidates[0]
    params = model.num_params()
    notes.append(f"step time {best.step_time_s:.3f} s: planner's fastest layout of {model.name} on {nodes} x "
                 f"{system.name}, seq {seq}, global batch {global_batch} ({best.layout.to_dict()})")
    notes.append(f"checkpoint {params * CHECKPOINT_BYTES_PER_PARAM / 1e12:.2f} TB = {params / 1e9:.1f}B params x "
                 f"{CHECKPOINT_BYTES_PER_PARAM} bytes (bf16 weights, fp32 master, Adam m and v)")
    return {"devices": devices, "step_time_s": float(best.step_time_s),
            "checkpoint_bytes": float(params * CHECKPOINT_BYTES_PER_PARAM)}
