// Delta plan: which groups contain a leaver, and which of those a given rank rebuilds.
// Pure arithmetic over the CSR layout; no NCCL/CUDA include, so it builds and tests anywhere.
// Mirrors trainmover/runtime/plan.py (delta, Delta.groups_to_build); a contract test keeps
// the two in agreement.
#include <algorithm>
#include <vector>

#include "error.h"

namespace {

int validate(int ngroups, const int* offsets, const int* ranks, int nleavers, const int* leavers) {
  TM_CHECK_ARG(ngroups >= 0, "plan: ngroups %d < 0", ngroups);
  TM_CHECK_ARG(offsets != nullptr, "plan: offsets is null");
  TM_CHECK_ARG(offsets[0] == 0, "plan: offsets[0] is %d, must be 0", offsets[0]);
  TM_CHECK_ARG(ngroups == 0 || ranks != nullptr, "plan: ranks is null");
  std::vector<int> members;
  for (int g = 0; g < ngroups; ++g) {
    const int lo = offsets[g], hi = offsets[g + 1];
    TM_CHECK_ARG(hi > lo, "plan: group %d is empty (offsets %d..%d)", g, lo, hi);
    members.assign(ranks + lo, ranks + hi);
    std::sort(members.begin(), members.end());
    TM_CHECK_ARG(members.front() >= 0, "plan: group %d has negative rank %d", g, members.front());
    auto dup = std::adjacent_find(members.begin(), members.end());
    TM_CHECK_ARG(dup == members.end(), "plan: group %d: ranks must be distinct, %d repeats", g,
                 dup == members.end() ? -1 : *dup);
  }
  TM_CHECK_ARG(nleavers >= 1 && leavers != nullptr, "plan: no leaving ranks given");
  for (int i = 0; i < nleavers; ++i) {
    const int r = leavers[i];
    bool found = false;
    for (int k = 0; k < offsets[ngroups] && !found; ++k) found = ranks[k] == r;
    TM_CHECK_ARG(found, "plan: leaving rank %d is not in the job's groups", r);
  }
  return TM_OK;
}

bool contains(const int* begin, const int* end, int r) { return std::find(begin, end, r) != end; }

bool changed_group(const int* offsets, const int* ranks, int g, int nleavers, const int* leavers) {
  for (int i = 0; i < nleavers; ++i)
    if (contains(ranks + offsets[g], ranks + offsets[g + 1], leavers[i])) return true;
  return false;
}

}  // namespace

extern "C" int tm_plan_changed(int ngroups, const int* offsets, const int* ranks, int nleavers,
                               const int* leavers, unsigned char* changed) {
  TM_CHECK(validate(ngroups, offsets, ranks, nleavers, leavers));
  TM_CHECK_ARG(ngroups == 0 || changed != nullptr, "plan: changed is null");
  for (int g = 0; g < ngroups; ++g)
    changed[g] = changed_group(offsets, ranks, g, nleavers, leavers) ? 1 : 0;
  return TM_OK;
}

extern "C" int tm_plan_for_rank(int ngroups, const int* offsets, const int* ranks, int nleavers,
                                const int* leavers, int rank, int capacity, int* out_groups,
                                int* out_group_ranks, int* out_count) {
  TM_CHECK(validate(ngroups, offsets, ranks, nleavers, leavers));
  TM_CHECK_ARG(out_count != nullptr, "plan: out_count is null");
  TM_CHECK_ARG(capacity == 0 || (out_groups && out_group_ranks), "plan: output arrays are null");
  int n = 0;
  for (int g = 0; g < ngroups; ++g) {
    if (!changed_group(offsets, ranks, g, nleavers, leavers)) continue;
    const int* begin = ranks + offsets[g];
    const int* end = ranks + offsets[g + 1];
    const int* at = std::find(begin, end, rank);
    if (at == end) continue;
    if (n < capacity) {
      out_groups[n] = g;
      out_group_ranks[n] = static_cast<int>(at - begin);
    }
    ++n;
  }
  *out_count = n;
  TM_CHECK_ARG(n <= capacity, "plan: rank %d is in %d changed groups, capacity is %d", rank, n,
               capacity);
  return TM_OK;
}
