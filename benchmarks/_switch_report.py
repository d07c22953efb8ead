"""Turn the per-rank records of ``switch_vs_checkpoint.py``'s jobs into per-pair figures, a table and
geometric means. Pure functions over plain dicts (no torch), so the script's spawned children can
import this module cheaply."""

from __future__ import annotations

import math

GOALS = {  # metric -> (goal, "higher" or "lower" is better)
    "speedup_vs_dcp": (8.0, "higher"),
    "speedup_vs_megatron_ckpt": (8.0, "higher"),
    "speedup_vs_restart": (50.0, "higher"),
    "speedup_vs_allgather": (3.0, "higher"),
    "time_over_floor": (1.5, "lower"),
}
BASELINES = {"dcp": "speedup_vs_dcp", "megatron": "speedup_vs_megatron_ckpt", "restart": "speedup_vs_restart",
             "allgather": "speedup_vs_allgather"}
#: the ahead-of-time switch's goals (issue "ahead-of-time switches"): under ``geomean_ahead``
AHEAD_GOALS = {"time_over_floor": (1.25, "lower"), "speedup_vs_dcp": (8.0, "higher")}
GB = 1e9


def _restart(first: dict, second: list[dict] | None) -> dict | None:
    save = first.get("restart_save")
    if not save or not second:
        return None
    entered = min(r["process_entered_at"] for r in second)
    r = second[0]
    return dict(seconds=r["loaded_at"] - save["decided_at"], save_seconds=save["saved_at"] - save["decided_at"],
                exit_and_spawn_seconds=entered - save["saved_at"], startup_seconds=r["fn_started_at"] - entered,
                build_seconds=r["built_at"] - r["fn_started_at"], load_seconds=r["loaded_at"] - r["built_at"],
                passed=r["passed"], diff=r["diff"])


def summarize(src: str, dst: str, ranks: list[dict], restart: list[dict] | None) -> dict:
    """One pair's figures from job 1's per-rank records (and the restart job's)."""
    first = ranks[0]
    methods = dict(first["methods"])
    for name in methods:
        methods[name] = dict(methods[name], peak_rss_sum=sum(r["methods"][name]["peak_rss"] for r in ranks),
                             rss_before_sum=sum(r["methods"][name]["rss_before"] for r in ranks),
                             machine_pages=first["methods"][name].get("machine_pages_bytes", 0))
    checks = {m: c["passed"] for m, c in first["checks"].items()}
    restarted = _restart(first, restart)
    if restarted is not None:
        methods["restart"] = restarted
        checks["restart"] = restarted["passed"]
    floor = first["floor"]
    seconds = {m: rec["seconds"] for m, rec in methods.items()}
    seconds["floor"] = floor["seconds"]
    hot = methods.get("hot_switch")
    out = dict(pair=f"{src} -> {dst}", src=src, dst=dst, seconds=seconds, methods=methods, floor=floor,
               speeds=first["speeds"], checks=checks, all_checks_passed=all(checks.values()) and bool(checks),
               restores=first["restores"], skipped=first["skipped"], errors=first["errors"],
               base_rss_sum=sum(r["base_rss"] for r in ranks), build_trained_seconds=first["build_trained_seconds"],
               dst_groups_seconds=first["dst_groups_seconds"])
    if floor["seconds"] > 0:  # what a switch running exactly at the floor would give against each baseline
        for method, key in BASELINES.items():
            if method in seconds:
                out["at_floor_" + key] = seconds[method] / floor["seconds"]
    ahead = methods.get("hot_switch_ahead")
    if ahead is not None:
        seconds["hot_switch_ahead_engine"] = ahead["engine_seconds"]
        seconds["hot_switch_ahead_bind"] = ahead["rebuild_seconds"]
        out.update(_against(ahead["seconds"], seconds, floor["seconds"], prefix="ahead_"))
    if hot is not None:
        engine = hot["engine_seconds"]
        seconds["hot_switch_engine"] = engine
        seconds["hot_switch_rebuild"] = hot["rebuild_seconds"]
        out["peak_staging_bytes"] = hot["peak_staging_bytes"]
        out.update(_against(hot["seconds"], seconds, floor["seconds"], prefix=""))
        out.update(_against(engine, seconds, floor["seconds"], prefix="engine_"))
    return out


def _against(hot_seconds: float, seconds: dict, floor_seconds: float, *, prefix: str) -> dict:
    """A switch's speedup over each baseline that ran, and its time over the floor."""
    out = {prefix + key: seconds[method] / hot_seconds for method, key in BASELINES.items() if method in seconds}
    if floor_seconds > 0:
        out[prefix + "time_over_floor"] = hot_seconds / floor_seconds
    return out


def compact(row: dict) -> dict:
    """The JSON of one pair without the per-method detail records (``--json-full`` keeps them)."""
    keep = ("pair", "seconds", "checks", "all_checks_passed", "skipped", "peak_staging_bytes", "wall_seconds",
            "load_average_before")
    out = {k: row[k] for k in keep if k in row}
    out.update({k: v for k, v in row.items()
                if k.startswith(("speedup_", "engine_speedup_", "time_over", "engine_time", "at_floor_", "ahead_"))})
    out["errors"] = {m: e.strip().splitlines()[-1] for m, e in row.get("errors", {}).items()}
    floor = row["floor"]
    out["bytes"] = dict(moved=floor["recv_bytes_total"], kept=floor["retained_bytes_total"])
    out["speeds"] = row["speeds"]
    hot = row["methods"].get("hot_switch")
    if hot:
        out["hot_switch"] = {k: hot[k] for k in ("plan_seconds", "rebuild_seconds", "engine_seconds", "release_seconds",
                                                 "in_place_bytes", "p2p_direct_bytes", "old_freed_bytes",
                                                 "need_bytes", "recycled_bytes") if k in hot}
        out["hot_switch"]["rebuild_steps"] = {k.strip("_"): round(v, 4) for k, v in hot["steps"].items()
                                              if k != "engine"}
    ahead = row["methods"].get("hot_switch_ahead")
    if ahead:
        out["hot_switch_ahead"] = {k: ahead[k] for k in ("ahead_seconds", "ahead_build_seconds", "rebuild_seconds",
                                                         "engine_seconds", "release_seconds") if k in ahead}
    out["peak_rss_sum"] = {m: r["peak_rss_sum"] for m, r in row["methods"].items() if "peak_rss_sum" in r}
    out["machine_pages"] = {m: r["machine_pages"] for m, r in row["methods"].items() if "machine_pages" in r}
    out["warm_seconds"] = {m: r["warm_seconds"] for m, r in row["methods"].items() if "warm_seconds" in r}
    return out


def rounded(value, digits: int = 4):
    """Floats to ``digits`` significant digits, recursively (a shorter JSON line, same information)."""
    if isinstance(value, float):
        return float(f"{value:.{digits}g}")
    if isinstance(value, dict):
        return {k: rounded(v, digits) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [rounded(v, digits) for v in value]
    return value


def geomean(values: list[float]) -> float | None:
    values = [v for v in values if v is not None and v > 0]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None


def geomeans(rows: list[dict]) -> dict:
    keys = (list(GOALS) + ["engine_" + k for k in GOALS] + ["at_floor_" + k for k in BASELINES.values()]
            + ["peak_staging_bytes"])
    out: dict = {}
    for key in keys:
        values = [r[key] for r in rows if r.get(key)]
        out[key] = geomean(values)
        out[key + "_pairs"] = len(values)
    return out


def geomeans_ahead(rows: list[dict]) -> dict:
    """``geomeans``' keys for the ahead-of-time switch (``hot_switch_ahead``), where it ran."""
    out: dict = {}
    for key in GOALS:
        values = [r["ahead_" + key] for r in rows if r.get("ahead_" + key)]
        out[key] = geomean(values)
        out[key + "_pairs"] = len(values)
    return out


def goals(means: dict, table: dict = GOALS) -> dict:
    """Each goal, its value and whether it is met; for a speedup, also what a switch running exactly
    at the floor would reach (``at_floor``): a goal above that asks for more than this machine's
    links and memory copies give, unless the switch keeps state in place (which the floor counts
    as copied)."""
    out = {}
    for key, (goal, better) in table.items():
        value = means.get(key)
        met = value is not None and (value >= goal if better == "higher" else value <= goal)
        out[key] = dict(goal=goal, better=better, value=value, met=met)
        if "at_floor_" + key in means:
            bound = means["at_floor_" + key]
            out[key].update(at_floor=bound, reachable_at_floor=bound is not None and bound >= goal)
    return out


# ------------------------------------------------------------------------------------------ text
def _s(value: float | None) -> str:
    return "-" if value is None else (f"{value:.3f}" if value < 10 else f"{value:.1f}")


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}x"


def table(rows: list[dict], means: dict) -> str:
    head = (f"{'pair':<40} {'hot s':>7} {'engine':>7} {'rebuild':>7} {'allgat':>7} {'dcp':>7} {'mcore':>7} "
            f"{'restart':>7} {'floor':>7} {'moved':>7} {'kept':>7} {'xdcp':>6} {'xmcore':>6} {'xrest':>6} "
            f"{'xallg':>6} {'/floor':>6}  checks")
    lines = [head, "-" * len(head)]
    for r in rows:
        s = r["seconds"]
        checks = " ".join(f"{m}:{'ok' if ok else 'FAIL'}" for m, ok in r["checks"].items())
        lines.append(
            f"{r['pair']:<40} {_s(s.get('hot_switch')):>7} {_s(s.get('hot_switch_engine')):>7} "
            f"{_s(s.get('hot_switch_rebuild')):>7} {_s(s.get('allgather')):>7} {_s(s.get('dcp')):>7} "
            f"{_s(s.get('megatron')):>7} {_s(s.get('restart')):>7} {_s(s.get('floor')):>7} "
            f"{r['floor']['recv_bytes_total'] / GB:>6.2f}G {r['floor']['retained_bytes_total'] / GB:>6.2f}G "
            f"{_x(r.get('speedup_vs_dcp')):>6} {_x(r.get('speedup_vs_megatron_ckpt')):>6} "
            f"{_x(r.get('speedup_vs_restart')):>6} {_x(r.get('speedup_vs_allgather')):>6} "
            f"{_s(r.get('time_over_floor')):>6}  {checks}")
        if "hot_switch_ahead" in s:
            lines.append(f"{'':<4}built ahead: {_s(s['hot_switch_ahead'])} s (bind {_s(s['hot_switch_ahead_bind'])}, "
                         f"engine {_s(s['hot_switch_ahead_engine'])}), {_x(r.get('ahead_speedup_vs_dcp'))} dcp, "
                         f"{_s(r.get('ahead_time_over_floor'))} of the floor; built in the background in "
                         f"{_s(r['methods']['hot_switch_ahead']['ahead_seconds'])} s")
        for method, reason in r["skipped"].items():
            lines.append(f"{'':<4}skipped {method}: {reason}")
        for method, error in r["errors"].items():
            lines.append(f"{'':<4}ERROR {method}: {error.strip().splitlines()[-1]}")
    lines.append("-" * len(head))
    lines.append(
        f"{'geomean (hot switch incl. rebuild)':<40} {'':>7} {'':>7} {'':>7} {'':>7} {'':>7} {'':>7} {'':>7} {'':>7} "
        f"{'':>7} {'':>7} {_x(means['speedup_vs_dcp']):>6} {_x(means['speedup_vs_megatron_ckpt']):>6} "
        f"{_x(means['speedup_vs_restart']):>6} {_x(means['speedup_vs_allgather']):>6} {_s(means['time_over_floor']):>6}")
    lines.append(
        f"{'geomean (engine only)':<40} {'':>7} {'':>7} {'':>7} {'':>7} {'':>7} {'':>7} {'':>7} {'':>7} {'':>7} {'':>7} "
        f"{_x(means['engine_speedup_vs_dcp']):>6} {_x(means['engine_speedup_vs_megatron_ckpt']):>6} "
        f"{_x(means['engine_speedup_vs_restart']):>6} {_x(means['engine_speedup_vs_allgather']):>6} "
        f"{_s(means['engine_time_over_floor']):>6}")
    lines.append(
        f"{'geomean (a switch exactly at the floor)':<40} {'':>7} {'':>7} {'':>7} {'':>7} {'':>7} {'':>7} {'':>7} "
        f"{'':>7} {'':>7} {'':>7} {_x(means['at_floor_speedup_vs_dcp']):>6} "
        f"{_x(means['at_floor_speedup_vs_megatron_ckpt']):>6} {_x(means['at_floor_speedup_vs_restart']):>6} "
        f"{_x(means['at_floor_speedup_vs_allgather']):>6} {_s(1.0):>6}")
    return "\n".join(lines)


def _steps(steps: dict[str, float]) -> str:
    return " ".join(f"{k.strip('_')} {v:.3f}" for k, v in steps.items() if v >= 0.0005)


def profile(rows: list[dict]) -> str:
    """Where the hot switch's time goes, and the baselines' own breakdowns."""
    lines = ["", "where the time goes (seconds, slowest rank)"]
    for r in rows:
        m = r["methods"]
        lines.append(f"  {r['pair']}")
        if "hot_switch" in m:
            h = m["hot_switch"]
            phases = " ".join(f"{k} {v:.3f}" for k, v in h["phases"].items() if v >= 0.0005)
            lines.append(f"    hot switch {h['seconds']:.3f} = plan+prep {h['plan_seconds']:.3f} + rebuild "
                         f"{h['rebuild_seconds']:.3f} + engine {h['engine_seconds']:.3f} ({phases}) + drop old "
                         f"{h['release_seconds']:.3f} (+ waiting for the slowest rank); recv {h['recv_bytes'] / GB:.2f} GB, kept "
                         f"{h['retained_bytes'] / GB:.2f} GB ({h.get('in_place_bytes', 0) / GB:.2f} GB of it in place), "
                         f"{h.get('p2p_direct_bytes', 0) / GB:.2f} GB of p2p straight from/into storage, old state freed "
                         f"during the switch {h.get('old_freed_bytes', 0) / GB:.2f} GB (new state written into "
                         f"{h.get('recycled_bytes', 0) / GB:.2f} GB of it), peak staging "
                         f"{h['peak_staging_bytes'] / 2**20:.0f} MiB")
            lines.append("      rebuild + engine steps: " + _steps(h["steps"]))
            if h.get("need_bytes") is not None and "rss_before_sum" in h:
                lines.append(f"      memory beyond the state at the start, sum over ranks: measured peak "
                             f"{(h['peak_rss_sum'] - h['rss_before_sum']) / GB:.2f} GB, checked bound "
                             f"{h['need_bytes'] / GB:.2f} GB (memory_check.switch_need_bytes)")
        for name in ("dcp", "megatron", "allgather"):
            if name in m:
                lines.append(f"      {name}'s rebuild steps: " + _steps(m[name]["steps"]))
        if "allgather" in m:
            a = m["allgather"]
            lines.append(f"    allgather {a['seconds']:.3f} = rebuild {a['rebuild_seconds']:.3f} + gather/slice "
                         f"{a['gather_seconds']:.3f} (in all_gather {a['collective_seconds']:.3f}, "
                         f"{a['collectives']} calls, {a['recv_bytes'] / GB:.2f} GB received)")
        for name in ("dcp", "megatron"):
            if name in m:
                c = m[name]
                lines.append(f"    {name} {c['seconds']:.3f} = save {c['save_seconds']:.3f} + drop old "
                             f"{c['free_seconds']:.3f} + build {c['build_seconds']:.3f} + load {c['load_seconds']:.3f}"
                             f" ({c['checkpoint_bytes'] / GB:.2f} GB on disk)")
        if "restart" in m:
            c = m["restart"]
            lines.append(f"    restart {c['seconds']:.3f} = save {c['save_seconds']:.3f} + exit and spawn "
                         f"{c['exit_and_spawn_seconds']:.3f} + start-up {c['startup_seconds']:.3f} + init/build "
                         f"{c['build_seconds']:.3f} + load {c['load_seconds']:.3f}")
        sp = r["speeds"]
        f = r["floor"]
        lines.append(f"    floor {f['seconds']:.3f} (slowest rank) = {f['transfer_seconds']:.3f} receiving at "
                     f"{sp['p2p_pair_bytes_per_s'] / GB:.2f} GB/s p2p + {f['copy_seconds']:.3f} copying at "
                     f"{sp['copy_bytes_per_s'] / GB:.2f} GB/s copy_ (most a rank receives {f['recv_bytes_max'] / GB:.2f}"
                     f" GB, keeps {f['retained_bytes_max'] / GB:.2f} GB); all ranks' {f['recv_bytes_total'] / GB:.2f} GB"
                     f" at the {sp['p2p_aggregate_bytes_per_s'] / GB:.2f} GB/s aggregate would take "
                     f"{f['aggregate_seconds']:.3f}")
        peaks = " ".join(f"{k} {v['peak_rss_sum'] / GB:.1f}" for k, v in m.items() if "peak_rss_sum" in v)
        if peaks:
            lines.append(f"    peak RSS, sum over ranks (GB): {peaks}")
        fresh = " ".join(f"{k} {v['machine_pages'] / GB:.1f}" for k, v in m.items() if "machine_pages" in v)
        if fresh:
            lines.append(f"    fresh pages the kernel handed out during the method, whole machine (GB): {fresh}")
        warm = " ".join(f"{k} {v['warm_seconds']:.1f}" if v["warm_seconds"] > 0 else f"{k} NOT WARMED (did not fit)"
                        for k, v in m.items() if "warm_seconds" in v)
        if warm:
            lines.append(f"    memory written and freed before the method, untimed (s): {warm}")
        lines.append(f"    process groups of B made before any method, untimed: {r['dst_groups_seconds']:.3f} s "
                     "(every in-process method finds them; the restart makes its own)")
    return "\n".join(lines)
