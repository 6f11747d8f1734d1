"""Turn bench/results/*.json into docs/benchmarks.md's results block and plots (issue #9).

    .venv/bin/python bench/make_report.py [--check]

* docs/benchmarks.md: the text between `<!-- bench:report:begin -->` and `<!-- bench:report:end -->`
  is replaced (nothing else is touched): one table of TrainMover vs checkpoint-restart per
  side-by-side result (same run, same machine), the per-phase breakdown, and downtime
  against the number of ranks with its least-squares slope.
* bench/results/plots/: `gantt-<scenario>-<machine>.png` (the event's timeline, phase by
  phase, both systems) and `scaling-<machine>.png` (downtime against ranks).

The newest file per (scenario, machine) is used. `--check` fails when docs/benchmarks.md is not what
this script would write (for CI). Rendering is pure (`render_block`), tested on a fixture in
tests/unit/test_make_report.py.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
PLOTS = RESULTS / "plots"
BEGIN, END = "<!-- bench:report:begin -->", "<!-- bench:report:end -->"
GPU_RATIO_GOAL = 1 / 50


def load(results_dir: Path) -> list[dict]:
    out = []
    for p in sorted(results_dir.glob("*.json")):
        r = json.loads(p.read_text())
        r["_file"] = p.name
        out.append(r)
    return out


def newest(results: list[dict], prefix: str) -> list[dict]:
    """The newest result per (scenario, machine) among scenarios starting with `prefix`."""
    best: dict[tuple, dict] = {}
    for r in results:
        if r.get("scenario", "").startswith(prefix):
            key = (r["scenario"], r.get("machine"))
            if key not in best or r.get("when", "") > best[key].get("when", ""):
                best[key] = r
    return [best[k] for k in sorted(best)]


def s(x) -> str:
    """Seconds, 3 significant digits; '-' for nothing."""
    if x is None:
        return "-"
    return f"{x:.3g} s"


def nbytes(x) -> str:
    if x is None:
        return "-"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3g} {unit}"
    return f"{x:.0f} B"


def ratio(tm, base) -> str:
    if not tm or not base:
        return "-"
    return f"1/{base / tm:.0f} ({tm / base:.4f})"


def where(r: dict) -> str:
    gpus = r.get("gpus", "none")
    return f"{r['machine']} ({gpus if gpus != 'none' else r.get('cpu', 'CPU')})"


def side_by_side_table(results: list[dict], failures: list[dict] = ()) -> str:
    """`failures`: TrainMover's own unexpected-failure results (unexpected-failure-* scenarios),
    shown, marked as a separate run, where a side-by-side run did not measure that path."""
    rows = ["| scenario | machine | TrainMover downtime | checkpoint-restart downtime | ratio | "
            "stayers' throughput in Phase 1 | stayers' memory growth | state copy vs p2p | command |",
            "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        m, st = r["metrics"], r.get("settings", {})
        workers = st.get("workers")
        workload = st.get("workload") or (f"gpt_demo {st['preset']}" if "preset" in st else "?")
        what = f"{workload}, {workers} ranks" if workers else workload
        goal = " (goal <= 1/50)" if r.get("gpus", "none") != "none" else ""
        mem = m.get("stayer_device_mem_growth_bytes")
        mem_txt = (f"{nbytes(mem)} device, {nbytes(m.get('stayer_extra_alloc_bytes'))} allocator"
                   if mem is not None else "n/a (CPU)")
        copy = (f"{nbytes(m.get('state_bytes'))} at {m['state_copy_GBps']:.3g} GB/s vs {m['p2p_GBps']:.3g} GB/s"
                if m.get("state_copy_GBps") and m.get("p2p_GBps") else "-")
        thr = f"{m['stayer_throughput_ratio']:.1%}" if m.get("stayer_throughput_ratio") else "-"
        rows.append(f"| planned, {what} | {where(r)} | {s(m.get('planned_downtime_s'))} | "
                    f"{s(m.get('baseline_downtime_s'))} | {ratio(m.get('planned_downtime_s'), m.get('baseline_downtime_s'))}"
                    f"{goal} | {thr} | {mem_txt} | {copy} | `{r['command']}` |")
        if "baseline_unexpected_downtime_s" in m:
            tm_u = m.get("unexpected_downtime_s")
            lost = m.get("baseline_lost_steps_all") or []
            base_txt = (f"{s(m['baseline_unexpected_downtime_s'])} to the first step; {lost and sorted(lost)[len(lost) // 2]} "
                        f"steps lost, progress regained after {s(m.get('baseline_regained_s'))}")
            tm_txt = s(tm_u) if tm_u is not None else (m.get("unexpected_note") or "not measured")
            separate = next((f for f in failures if f.get("machine") == r.get("machine")), None)
            if tm_u is None and separate is not None:
                tm_txt = (f"{s(separate['metrics']['unexpected_downtime_s'])} (separate run: "
                          f"`{separate['_file']}`)")
            rows.append(f"| unexpected failure, {what} | {where(r)} | {tm_txt} | "
                        f"{base_txt} | {ratio(tm_u, m['baseline_unexpected_downtime_s'])} | - | - | - | same |")
    return "\n".join(rows)


def merge_order(names: list[str], more: list[str]) -> list[str]:
    """`names` with the entries of `more` it lacks, each placed after its predecessor in `more`
    (or before its successor): phases keep the order in which a restart passes them."""
    out = list(names)
    for i, k in enumerate(more):
        if k in out:
            continue
        before = next((out.index(p) + 1 for p in reversed(more[:i]) if p in out), None)
        after = next((out.index(n) for n in more[i + 1:] if n in out), None)
        out.insert(before if before is not None else after if after is not None else len(out), k)
    return out


def phase_table(r: dict) -> str:
    m = r["metrics"]
    cols = [("TrainMover planned", m.get("trainmover_phases_s") or {}),
            ("checkpoint-restart planned", m.get("baseline_phases_s") or {}),
            ("checkpoint-restart failure", m.get("baseline_failure_phases_s") or {})]
    cols = [(name, d) for name, d in cols if d]
    names: list[str] = []
    for _, d in cols:
        names = merge_order(names, list(d))
    head = "| phase (median) | " + " | ".join(n for n, _ in cols) + " |"
    lines = [head, "|---|" + "---|" * len(cols)]
    for k in names:
        lines.append(f"| {k} | " + " | ".join(s(d.get(k)) if k in d else "" for _, d in cols) + " |")
    return "\n".join(lines)


def scaling_table(r: dict) -> str:
    m = r["metrics"]
    ranks = [str(n) for n in m["ranks"]]
    base = m.get("baseline_downtime_s_by_ranks") or {}
    lines = ["| ranks | TrainMover downtime (median) | all | steady step | checkpoint-restart downtime | ratio |",
             "|---|---|---|---|---|---|"]
    for n in ranks:
        lines.append(f"| {n} | {s(m['planned_downtime_s_by_ranks'][n])} | "
                     f"{', '.join(f'{x:.3f}' for x in m['planned_downtime_s_all_by_ranks'][n])} | "
                     f"{s(m['steady_step_s_by_ranks'][n])} | {s(base.get(n))} | "
                     f"{ratio(m['planned_downtime_s_by_ranks'][n], base.get(n))} |")
    slope = m.get("planned_downtime_slope_s_per_rank")
    bslope = m.get("baseline_downtime_slope_s_per_rank")
    lines.append("")
    lines.append(f"Least-squares slope of TrainMover's downtime: **{slope * 1000:+.2f} ms per rank** "
                 f"(of the medians: {m['planned_downtime_slope_s_per_rank_of_medians'] * 1000:+.2f} ms per rank)"
                 + (f"; checkpoint-restart: {bslope * 1000:+.0f} ms per rank" if bslope is not None else "")
                 + f". Machine: {r['machine']} ({r.get('cpu', r.get('gpus'))}){load_note(r)}; `{r['command']}` at {r['commit'][:10]}."
                 + (f" {m['failed_trials']} trial(s) failed and are left out (the JSON's `failed_trials` says why)."
                    if m.get("failed_trials") else ""))
    return "\n".join(lines)


def load_note(r: dict) -> str:
    """The shared CPU machine's load average when the result was written (noise, said openly)."""
    la = r.get("load_avg_1_5_15_min_at_end")
    return f", load average {la[0]:g}/{la[1]:g}/{la[2]:g} (1/5/15 min) at the end" if la else ""


def render_block(results: list[dict], plots: dict[str, str] | None = None) -> str:
    """The README block (markers included) for `results`; `plots`: caption -> relative path."""
    parts = [BEGIN, "", "<!-- generated by bench/make_report.py from bench/results/*.json: do not edit by hand -->", ""]
    sbs = newest(results, "side-by-side")
    if sbs:
        parts += ["**TrainMover vs checkpoint-restart, same run, same machine.** The baseline trains the same "
                  "workload as a plain Slurm job: at the event it checkpoints to the job's directory (planned) or "
                  "loses the steps since its last periodic checkpoint (failure), the job ends, a new job is "
                  "submitted and Slurm starts it on healthy nodes; processes start, rebuild communicators, build the "
                  "model, load the checkpoint and run a first step (`trainmover/baseline/`). Downtime as defined "
                  "in `shared/reference/bench-results.md`.", "",
                  side_by_side_table(sbs, newest(results, "unexpected-failure")), ""]
        for r in sbs:
            parts += [f"Phases, {r['scenario']} on {r['machine']}{load_note(r)} ({r['when']}, commit {r['commit'][:10]}, "
                      f"{r.get('settings', {}).get('repeats', '?')} repeats; \"training continues\" phases cost the job no "
                      "pause):", "", phase_table(r), ""]
    for r in newest(results, "scaling"):
        parts += [f"**Downtime against ranks** ({r['scenario']}, one rank per node):", "", scaling_table(r), ""]
    for caption, path in (plots or {}).items():
        parts += [f"![{caption}]({path})", ""]
    parts.append(END)
    return "\n".join(parts)


def replace_block(readme: str, block: str) -> str:
    """`readme` with the marked block replaced; the block is appended to the 'Measured'
    section (before the next '## ' heading) when the markers are not there yet."""
    if BEGIN in readme and END in readme:
        head, rest = readme.split(BEGIN, 1)
        return head + block + rest.split(END, 1)[1]
    at = readme.find("\n## ", readme.find("## Measured") + 1) if "## Measured" in readme else -1
    if at < 0:
        return readme.rstrip("\n") + "\n\n" + block + "\n"
    return readme[:at].rstrip("\n") + "\n\n" + block + "\n" + readme[at:]


# --- plots (effects: files) ---------------------------------------------------------------

def _median_trial(trials: list[dict]) -> dict:
    timed = [t for t in trials if "failure" not in t]  # a TrainMover failure trial kept next to them
    return sorted(timed, key=lambda t: t["downtime_s"])[len(timed) // 2]


def plot_gantt(r: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    tr = r["trials"]
    rows = []

    def trainmover(label: str, chart: list[dict]) -> None:
        # the stayers' step across the switch overlaps the switch phase: a lane of its own
        rows.append((f"{label}: controller", [p for p in chart if not p["phase"].startswith("stayers")]))
        rows.append((f"{label}: stayers", [p for p in chart if p["phase"].startswith("stayers")]))
    if tr.get("trainmover_planned"):
        trainmover("TrainMover, planned", _median_trial(tr["trainmover_planned"])["gantt"])
    if tr.get("baseline_planned"):
        rows.append(("checkpoint-restart, planned", _median_trial(tr["baseline_planned"])["phases"]))
    if tr.get("baseline_failure"):
        rows.append(("checkpoint-restart, failure", _median_trial(tr["baseline_failure"])["phases"]))
    if tr.get("trainmover_failure"):
        trainmover("TrainMover, failure", _median_trial(tr["trainmover_failure"])["gantt"])
    names = list(dict.fromkeys(p["phase"] for _, ps in rows for p in ps))
    cmap = plt.get_cmap("tab20")
    color = {n: cmap(i % 20) for i, n in enumerate(names)}
    tm_rows = [(label, ps) for label, ps in rows if label.startswith("TrainMover")]
    fig, axes = plt.subplots(2, 1, figsize=(12, 7), gridspec_kw={"height_ratios": [len(rows), max(1, len(tm_rows))]})
    for ax, subset, title in ((axes[0], rows, "all, one time axis"), (axes[1], tm_rows, "TrainMover only, zoomed")):
        for y, (label, ps) in enumerate(subset):
            for p in ps:
                overlapped = "training continues" in p["phase"] or p["phase"].startswith("detect (")
                ax.barh(y, p["end_s"] - p["start_s"], left=p["start_s"], color=color[p["phase"]],
                        hatch="//" if overlapped else None, edgecolor="black", linewidth=0.3)
        ax.set_yticks(range(len(subset)), [label for label, _ in subset])
        ax.invert_yaxis()
        ax.set_xlabel("seconds since the drain / fault")
        ax.set_title(title, fontsize=9)
    handles = [plt.Rectangle((0, 0), 1, 1, color=color[n]) for n in names]
    fig.legend(handles, names, loc="lower center", ncol=3, fontsize=7, frameon=False)
    fig.suptitle(f"{r['scenario']} on {where(r)}: median trial of each; "
                 "hatched = training continues", fontsize=10)
    fig.tight_layout(rect=(0, 0.14, 1, 0.96))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_scaling(r: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    m = r["metrics"]
    ranks = m["ranks"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for n in ranks:
        ys = m["planned_downtime_s_all_by_ranks"][str(n)]
        ax.scatter([n] * len(ys), ys, color="tab:blue", s=12, alpha=0.6)
    ax.plot(ranks, [m["planned_downtime_s_by_ranks"][str(n)] for n in ranks], "o-", color="tab:blue",
            label=f"TrainMover planned (median; slope {m['planned_downtime_slope_s_per_rank'] * 1000:+.2f} ms/rank)")
    if m.get("baseline_downtime_s_by_ranks"):
        ax.plot(ranks, [m["baseline_downtime_s_by_ranks"][str(n)] for n in ranks], "s-", color="tab:red",
                label=f"checkpoint-restart planned (slope {m['baseline_downtime_slope_s_per_rank'] * 1000:+.0f} ms/rank)")
    ax.plot(ranks, [m["steady_step_s_by_ranks"][str(n)] for n in ranks], ":", color="gray", label="steady step")
    ax.set_yscale("log")
    ax.set_xticks(ranks)
    ax.set_xlabel("ranks (one per node)")
    ax.set_ylabel("downtime (s, log scale)")
    ax.set_title(f"downtime against ranks, {r['machine']} ({r.get('cpu', r.get('gpus'))})", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def make_plots(results: list[dict], plots_dir: Path) -> dict[str, str]:
    plots_dir.mkdir(parents=True, exist_ok=True)
    made = {}
    for r in newest(results, "side-by-side"):
        p = plots_dir / f"gantt-{r['scenario']}-{r['machine']}.png"
        plot_gantt(r, p)
        made[f"timeline, {r['scenario']} on {r['machine']}"] = "../" + str(p.relative_to(ROOT))  # linked from docs/
    for r in newest(results, "scaling"):
        p = plots_dir / f"scaling-{r['machine']}.png"
        plot_scaling(r, p)
        made[f"downtime against ranks, {r['machine']}"] = "../" + str(p.relative_to(ROOT))  # linked from docs/
    return made


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", default=str(RESULTS))
    ap.add_argument("--readme", default=str(ROOT / "docs" / "benchmarks.md"))
    ap.add_argument("--check", action="store_true", help="only check that docs/benchmarks.md is up to date (no plots)")
    args = ap.parse_args(argv)
    results = load(Path(args.results))
    readme = Path(args.readme)
    if args.check:
        plots = {f"timeline, {r['scenario']} on {r['machine']}": f"../bench/results/plots/gantt-{r['scenario']}-{r['machine']}.png"
                 for r in newest(results, "side-by-side")}
        plots.update({f"downtime against ranks, {r['machine']}": f"../bench/results/plots/scaling-{r['machine']}.png"
                      for r in newest(results, "scaling")})
        want = replace_block(readme.read_text(), render_block(results, plots))
        if want != readme.read_text():
            print(f"{readme} is out of date: run python bench/make_report.py", file=sys.stderr)
            return 1
        return 0
    plots = make_plots(results, PLOTS)
    block = render_block(results, plots)
    readme.write_text(replace_block(readme.read_text(), block))
    print(block)
    print(f"wrote {readme} and {len(plots)} plot(s) under {PLOTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
