// tm_nccl_version and the NCCL-only entry points of the plan-only library (no NCCL there).
#include "error.h"

extern "C" int tm_nccl_version(int* compiled, int* runtime) {
  if (compiled) *compiled = 0;
  if (runtime) *runtime = 0;
  return TM_OK;
}
