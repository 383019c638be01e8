"""Hardware catalog: chips, interconnects and systems (TOML data with sources), no torch."""

from paratrain.hardware.catalog import (
    Catalog,
    CatalogError,
    Chip,
    Interconnect,
    System,
    Tier,
    get_catalog,
    load_catalog,
    resolve_system,
)

__all__ = ["Catalog", "CatalogError", "Chip", "Interconnect", "System", "Tier", "get_catalog", "load_catalog",
           "resolve_system"]
