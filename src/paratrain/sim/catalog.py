"""Fill the simulator's plain inputs from the hardware catalog and the planner, when they are installed."""

from __future__ import annotations


def fill_from_catalog(*, hardware: str | None, model: str | None, devices: int | None, seq: int | None,
                      global_batch: int | None) -> dict:
    raise ValueError("--hardware/--model need paratrain.hardware and paratrain.plan, which are not available yet;"
                     " give --devices, --devices-per-node, --step-time, --checkpoint-gb and --price instead")
