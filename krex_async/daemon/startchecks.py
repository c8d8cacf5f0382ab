"""Options that pass their types but name something this node lacks: a device spec it cannot serve,
a group that does not exist, a metrics address that is not one (or no prometheus-client). Asked by
config.check_here before anything starts, so `krex serve` exits 2 naming the flag, variable or file
line instead of exiting 1 after reconcile, probes and the watchdog had started."""

from __future__ import annotations


def problems(devices: str, groups: dict[str, str], metrics: str) -> list[tuple[str, str]]:
    """(option field, why) for each of these that cannot serve here; `groups`: {field: name}."""
    from krex_async.daemon.listener import find_group
    from krex_async.daemon.metrics import missing, parse_addr
    from krex_async.devices import check_spec

    out = []
    try:
        check_spec(devices)
    except ValueError as e:
        out.append(("devices", str(e)))
    for field, name in groups.items():
        if name and find_group(name) is None:
            out.append((field, f"{name!r}: no such group (a name or a gid)"))
    if metrics:
        try:
            parse_addr(metrics)
        except ValueError as e:
            out.append(("metrics", str(e)))
        if why := missing():
            out.append(("metrics", why))
    return out
