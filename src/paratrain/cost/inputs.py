"""What the cost commands are told: prices per node-hour (SYSTEM=USD), the [cost] table of a TOML file, and the
assumptions they make from both (flags win)."""

from __future__ import annotations


def parse_prices(items: list[str], flag: str = "--price-per-node-hour-usd", system: str | None = None) -> dict[str, float]:
    """SYSTEM=USD items (USD per node-hour) as {system: price}; a bare USD is for `system` where one is given."""
    from paratrain.hardware.catalog import resolve_system

    out = {}
    for item in items:
        name, _, value = (system, "=", item) if system and "=" not in item else item.partition("=")
        try:
            price = float(value)
        except ValueError:
            raise ValueError(f"{flag} '{item}': expected SYSTEM=USD (per node-hour), e.g. trn2.48xlarge=40") from None
        if not price > 0 or price == float("inf"):
            raise ValueError(f"{flag} '{item}': the price must be a number > 0")
        resolve_system(name)
        out[name] = price
    return out


COST_KEYS = ("purchase", "pue", "failures", "price_per_node_hour_usd")


def load_cost_config(path: str) -> dict:
    """The [cost] table of a TOML file, checked: unknown keys and bad values fail naming the key."""
    import tomllib

    from paratrain.cost.compare import FAILURE_MODELS
    from paratrain.hardware.catalog import PURCHASE_OPTIONS

    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except OSError as exc:
        raise ValueError(f"--config {path!r}: cannot read ({exc.strerror})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"--config {path!r}: not valid TOML: {exc}") from None
    table = data.get("cost")
    if not isinstance(table, dict):
        raise ValueError(f"--config {path!r}: no [cost] table; allowed keys: {', '.join(COST_KEYS)}")
    for key in table:
        if key not in COST_KEYS:
            raise ValueError(f"{path}: cost.{key}: unknown key; allowed: {', '.join(COST_KEYS)}")
    if "purchase" in table and table["purchase"] not in PURCHASE_OPTIONS:
        raise ValueError(f"{path}: cost.purchase = {table['purchase']!r}: allowed: {', '.join(PURCHASE_OPTIONS)}")
    if "failures" in table and table["failures"] not in FAILURE_MODELS:
        raise ValueError(f"{path}: cost.failures = {table['failures']!r}: allowed: {', '.join(FAILURE_MODELS)}")
    if "pue" in table and not (isinstance(table["pue"], int | float) and table["pue"] >= 1):
        raise ValueError(f"{path}: cost.pue = {table['pue']!r}: allowed: a number >= 1")
    prices = table.get("price_per_node_hour_usd", {})
    if not isinstance(prices, dict):
        raise ValueError(f"{path}: cost.price_per_node_hour_usd = {prices!r}: allowed: a table SYSTEM = USD")
    table = dict(table)
    table["price_per_node_hour_usd"] = parse_prices([f"{k}={v}" for k, v in prices.items()],
                                               f"{path}: cost.price_per_node_hour_usd")
    return table


def assumptions_from(args):
    """The cost assumptions: flags over the --config [cost] table over the defaults."""
    from paratrain.cost.compare import Assumptions

    conf = load_cost_config(args.config) if args.config else {}
    given = {key: conf.get(key) if getattr(args, key) is None else getattr(args, key)
             for key in ("pue", "failures", "purchase")}  # neither given: Assumptions' own default
    prices = {**conf.get("price_per_node_hour_usd", {}), **parse_prices(args.price_per_node_hour_usd)}
    return Assumptions(**{k: v for k, v in given.items() if v is not None}, prices=prices)
