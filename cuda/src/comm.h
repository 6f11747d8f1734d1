// The communicator handle and the NCCL/CUDA check macros (NCCL side of the library only).
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <atomic>
#include <mutex>
#include <string>

#include "error.h"

static_assert(NCCL_UNIQUE_ID_BYTES == TM_UNIQUE_ID_BYTES, "NCCL unique id size changed");

#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 28, 7)
#define TM_HAVE_REVOKE 1
#else
#define TM_HAVE_REVOKE 0
#endif

struct tm_comm {
  std::string name;
  int rank = -1, nranks = 0, device = -1;
  ncclComm_t nccl = nullptr;               // null once aborted/destroyed, and for test fakes
#ifdef TM_TEST
  bool fake = false;                       // made by tm_test_comm_fake (src/test_hook.cpp)
#endif
  std::atomic<int> state{TM_COMM_INITIALIZING};
  std::atomic<int> op_timeout_ms{300000};
  std::mutex mu;                           // serialises management calls (poll/revoke/abort/...)
};

namespace tmd {

// A handle with no NCCL communicator behind it: only the test build (make test,
// libtmdelta_test.so) can make one; in the production library this is always false.
inline bool is_fake(const tm_comm* c) {
#ifdef TM_TEST
  return c->fake;
#else
  (void)c;
  return false;
#endif
}

// "comm 'tp2' rank 1/4"
std::string describe(const tm_comm* c);
const char* comm_state_name(int state);
// Records an NCCL failure (with ncclGetLastError of the communicator when there is one).
int fail_nccl(const tm_comm* c, const char* phase, const char* call, ncclResult_t r,
              const char* file, int line);
int fail_cuda(const tm_comm* c, const char* phase, const char* call, cudaError_t e,
              const char* file, int line);
// Polls ncclCommGetAsyncError until it leaves ncclInProgress or timeout_ms passes.
// Success: TM_OK. NCCL error: TM_E_NCCL (state -> FAILED). Deadline: TM_E_TIMEOUT (state -> FAILED).
int settle(tm_comm* c, const char* phase, int timeout_ms);
// ncclCommAbort, state -> ABORTED. Caller holds c->mu.
int abort_locked(tm_comm* c, const char* phase);

}  // namespace tmd

// Returns a status from the calling function when an NCCL call fails. ncclInProgress is not a
// failure: on a non-blocking communicator it means "issued, settle with tmd::settle".
#define TM_NCCL_CHECK(comm, phase, call)                                              \
  do {                                                                                \
    ncclResult_t tm_nr_ = (call);                                                     \
    if (tm_nr_ != ncclSuccess && tm_nr_ != ncclInProgress)                            \
      return ::tmd::fail_nccl((comm), (phase), #call, tm_nr_, __FILE__, __LINE__);     \
  } while (0)

#define TM_CUDA_CHECK(comm, phase, call)                                              \
  do {                                                                                \
    cudaError_t tm_ce_ = (call);                                                      \
    if (tm_ce_ != cudaSuccess)                                                        \
      return ::tmd::fail_cuda((comm), (phase), #call, tm_ce_, __FILE__, __LINE__);     \
  } while (0)

#define TM_CHECK_COMM(c)                                   \
  TM_CHECK_ARG((c) != nullptr, "communicator handle is null")
