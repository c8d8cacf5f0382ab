"""Options that pass their types but cannot serve on this node (check_here): a device spec it cannot
serve, a group that does not exist, a metrics address that is not one (or no prometheus-client),
too many region cores, an unusable cgroup root, probe prefixes, launch libraries, the pool's user
and modules. Asked before anything starts, so `krex serve` exits 2 naming the flag, variable or
file line instead of exiting 1 after reconcile, probes and the watchdog had started."""

from __future__ import annotations

import os
from collections.abc import Mapping

from krex_async.daemon.config import ConfigError, ServeConfig


def problems(devices: str, groups: dict[str, str], metrics: str) -> list[tuple[str, str]]:
    """(option field, why) for each of these that cannot serve here; `groups`: {field: name}."""
    from krex_async.daemon.listener import find_group
    from krex_async.daemon.observe.metrics import missing, parse_addr
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


def check_here(cfg: ServeConfig, sources: Mapping[str, str]) -> list[str]:
    """Options that pass their types but cannot serve here, checked as `krex serve` starts (not by
    --print-config, which may describe another node). Raises ConfigError naming where each came from;
    returns notes on options that are valid but do nothing here, for the caller to say.

    - region_cores: a count, at most the cpus krex may use less one, which always stays for the
      other commands (regions/fence.py would reserve fewer without a word).
    - cgroup_root: a root given on purpose is used or refused; only the root krex finds itself falls
      back to signals (isolation.choose_backend, whose rule this asks first, to name the source). Not
      checked under --isolation signal, which uses none.
    - probe_prefixes: what the ioctl probe accepts (a bad one ended start-up in a traceback).
    - launch_libs, where the probes would use them: each names a file, or is a pattern matching
      one (one that did not was passed over without a word). --probes launches uses them; auto
      only where bcc runs (open_probes: else it falls back to tracefs or none, which take no
      libraries), so there they are a note, not an error: a config shared by nodes with and
      without bcc serves on both.
    - pool_user: a user who exists (and whom this daemon may run workers as), with a pool or
      without: serve resolves it either way, and refused it by exiting 1 without saying where the
      name came from.
    - pool_preload, pool_init (with a pool): modules the pool's interpreter finds, as the pool's
      user and with its workers' environment (daemon/commands/pools.py; a missing one stopped the pool after
      three dead workers, said only by `krex status`, and commands ran plainly).
    """
    from krex_async.daemon.commands.access import peer_uids
    from krex_async.isolation.cpuset import fmt
    from krex_async.probes.bpf_ioctl import check_prefixes

    def where(field: str) -> str:
        return sources.get(field, field)

    groups = {"socket_group": cfg.socket_group, "admin_group": cfg.admin_group}
    for field, problem in problems(cfg.devices, groups, cfg.metrics):
        raise ConfigError(f"{where(field)}: {problem}")
    try:
        peer_uids(cfg.run_as_peers)
    except ValueError as e:
        raise ConfigError(f"{where('run_as_peers')}: {e}") from None
    cpus = frozenset(os.sched_getaffinity(0))
    if cfg.region_cores >= len(cpus):
        raise ConfigError(
            f"{where('region_cores')}: {cfg.region_cores} region cores, but krex may use {len(cpus)} "
            f"cpus here ({fmt(cpus)}) and one always stays for the other commands: "
            f"give 0 to {len(cpus) - 1} (0: none reserved)"
        )
    if cfg.cgroup_root and cfg.isolation != "signal":
        from krex_async.isolation import RootUnusable, root_problem  # choose_backend's own rule

        if (why := root_problem(cfg.cgroup_root)) is not None:
            raise ConfigError(f"{where('cgroup_root')}: {why}; {RootUnusable.HINT} (or fall back to signals)")
    if cfg.probe_prefixes:
        try:
            check_prefixes(cfg.probe_prefix_list)
        except ValueError as e:
            raise ConfigError(f"{where('probe_prefixes')}: {e}") from None
    notes = []
    if cfg.launch_libs and cfg.probes == "auto" and (why := _no_launch_probe()):
        notes.append(
            f"{where('launch_libs')}: not used here: --probes auto ({sources.get('probes', 'the default')}) "
            f"runs launch uprobes only where bcc runs, and {why}"
        )
    elif cfg.launch_libs and cfg.probes in ("auto", "launches"):
        from krex_async.probes.launches import check_configured

        try:
            check_configured(cfg.launch_lib_list)
        except ValueError as e:
            raise ConfigError(
                f"{where('launch_libs')}: {e}; name libcuda / libhsa-runtime64 files (or glob "
                "patterns matching them) that exist here"
            ) from None
    if cfg.pool_user:
        from krex_async.daemon.commands.pools import pool_identity

        try:
            pool_identity(cfg.pool_user)
        except ValueError as e:
            raise ConfigError(f"{where('pool_user')}: {cfg.pool_user!r}: {e}") from None
    if cfg.pool_size > 0:
        from krex_async.daemon.commands.pools import module_problems

        for field, why in module_problems(cfg.pool_user, cfg.pool_preload_list, cfg.pool_init_list):
            raise ConfigError(f"{where(field)}: {why}")
    return notes


def _no_launch_probe() -> str:
    """Why `--probes auto` would run no launch probe here ("" when it would): what open_probes
    asks first (a BPF program compiling and loading, ~0.3 s), then what it falls back to."""
    from krex_async.probes import bcc_works, tracefs_works

    ok, why = bcc_works()
    if ok:
        return ""
    ok, why_not = tracefs_works()
    then = "falls back to tracefs, which takes no libraries" if ok else f"runs no probes (tracefs: {why_not})"
    return f"bcc cannot run here ({why}), so auto {then}"
