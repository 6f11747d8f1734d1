// Failure reporting shared by every part of the library (no NCCL/CUDA here).
// tmd::fail records the thread-local message and returns the status, so a check is one line:
//   if (bad) return TM_FAIL(TM_E_INVALID, "comm '%s' rank %d phase=init: ...", ...);
#pragma once

#include "tmdelta.h"

namespace tmd {

int fail(int status, const char* file, int line, const char* fmt, ...)
    __attribute__((format(printf, 4, 5)));
void clear_error();

}  // namespace tmd

#define TM_FAIL(status, ...) ::tmd::fail((status), __FILE__, __LINE__, __VA_ARGS__)

// Returns TM_E_INVALID from the calling function when `cond` does not hold.
#define TM_CHECK_ARG(cond, ...)                       \
  do {                                                \
    if (!(cond)) return TM_FAIL(TM_E_INVALID, __VA_ARGS__); \
  } while (0)

// Propagates a tm status (already described in the thread-local message).
#define TM_CHECK(call)                 \
  do {                                 \
    int tm_rc_ = (call);               \
    if (tm_rc_ != TM_OK) return tm_rc_; \
  } while (0)
