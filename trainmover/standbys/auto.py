"""`TM_STANDBYS=auto`: the pool size for a job, from its size and the site's rates (pure).

The controller calls `choose` once at start (and again, with the same inputs, after a restart
from its journal) and then keeps the pool at that size as it always does: a used or lost
standby is refilled (controller/policy/core.py). The choice and its reason go to status.json.
"""
from __future__ import annotations

from trainmover.standbys.model import best_size, ettr
from trainmover.standbys.site import SiteRates, hours


def choose(train_nodes: int, site: SiteRates) -> dict:
    """The pool size for a job of `train_nodes` nodes: the size after which one more standby
    would gain fewer training GPUs than the one node it costs, clamped to the site's bounds."""
    gpus = train_nodes * site.gpus_per_node
    job = site.job(gpus)
    best = best_size(job)
    k = min(max(best, site.min_standbys), site.max_standbys)
    e_k, blocked, _ = ettr(job, k)
    nxt = (ettr(job, k + 1)[0] - e_k) * gpus
    why = (f"{train_nodes} nodes x {site.gpus_per_node} GPUs = {gpus} GPUs, job MTTF {hours(1 / job.rate_per_h)} "
           f"({site.describe()}): best size {best}")
    if k != best:
        why += f", clamped to the site's {site.min_standbys}..{site.max_standbys}"
    why += (f"; with {k} the ETTR is {e_k:.4f} ({blocked:.1%} of interruptions find no warm standby), "
            f"one more would add {nxt:.1f} training GPUs for its {site.gpus_per_node}")
    return {"setting": "auto", "standbys": k, "best": best, "gpus": gpus, "job_mttf_h": 1 / job.rate_per_h,
            "ettr": e_k, "next_standby_gpus": nxt, "site": site.to_json(), "why": why}
