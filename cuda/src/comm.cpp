// Communicators: non-blocking init with a deadline, revoke/abort/destroy, release.
#include "comm.h"

#include <chrono>
#include <cstring>
#include <new>
#include <thread>

namespace {

std::atomic<long long> g_created{0};

using Clock = std::chrono::steady_clock;

// Backoff between polls: starts at 50 us, doubles up to 5 ms.
void backoff(std::chrono::microseconds* pause) {
  std::this_thread::sleep_for(*pause);
  *pause = std::min(*pause * 2, std::chrono::microseconds(5000));
}

}  // namespace

namespace tmd {

std::string describe(const tm_comm* c) {
  if (!c) return "comm (null)";
  return "comm '" + c->name + "' rank " + std::to_string(c->rank) + "/" + std::to_string(c->nranks);
}

const char* comm_state_name(int s) {
  static const char* const names[] = {"INITIALIZING", "READY", "FAILED", "REVOKED", "ABORTED",
                                      "DESTROYED"};
  return s >= 0 && s <= TM_COMM_DESTROYED ? names[s] : "?";
}

int fail_nccl(const tm_comm* c, const char* phase, const char* call, ncclResult_t r,
              const char* file, int line) {
  const char* last = (c && c->nccl) ? ncclGetLastError(c->nccl) : ncclGetLastError(nullptr);
  return fail(TM_E_NCCL, file, line, "%s phase=%s: %s failed: %s (%d)%s%s", describe(c).c_str(),
              phase, call, ncclGetErrorString(r), static_cast<int>(r), last && *last ? ": " : "",
              last ? last : "");
}

int fail_cuda(const tm_comm* c, const char* phase, const char* call, cudaError_t e,
              const char* file, int line) {
  return fail(TM_E_CUDA, file, line, "%s phase=%s: %s failed: %s", describe(c).c_str(), phase,
              call, cudaGetErrorString(e));
}

int settle(tm_comm* c, const char* phase, int timeout_ms) {
  if (is_fake(c) || !c->nccl) return TM_OK;
  const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
  auto pause = std::chrono::microseconds(50);
  for (;;) {
    ncclResult_t async = ncclSuccess;
    ncclResult_t r = ncclCommGetAsyncError(c->nccl, &async);
    if (r != ncclSuccess) {
      c->state = TM_COMM_FAILED;
      return fail_nccl(c, phase, "ncclCommGetAsyncError", r, __FILE__, __LINE__);
    }
    if (async == ncclSuccess) return TM_OK;
    if (async != ncclInProgress) {
      c->state = TM_COMM_FAILED;
      return fail_nccl(c, phase, "async error", async, __FILE__, __LINE__);
    }
    if (Clock::now() >= deadline) {
      c->state = TM_COMM_FAILED;
      return TM_FAIL(TM_E_TIMEOUT, "%s phase=%s: still in progress after %d ms; abort it",
                     describe(c).c_str(), phase, timeout_ms);
    }
    backoff(&pause);
  }
}

int abort_locked(tm_comm* c, const char* phase) {
  const int s = c->state;
  if (s == TM_COMM_ABORTED || s == TM_COMM_DESTROYED) return TM_OK;
  ncclComm_t nc = c->nccl;
  c->nccl = nullptr;
  c->state = TM_COMM_ABORTED;
  if (nc) {
    ncclResult_t r = ncclCommAbort(nc);
    if (r != ncclSuccess && r != ncclInProgress)
      return fail_nccl(c, phase, "ncclCommAbort", r, __FILE__, __LINE__);
  }
  return TM_OK;
}

}  // namespace tmd

using tmd::describe;

extern "C" int tm_nccl_version(int* compiled, int* runtime) {
  if (compiled) *compiled = NCCL_VERSION_CODE;
  if (runtime) {
    *runtime = 0;
    TM_NCCL_CHECK(nullptr, "version", ncclGetVersion(runtime));
  }
  return TM_OK;
}

extern "C" int tm_get_unique_id(char out[TM_UNIQUE_ID_BYTES]) {
  TM_CHECK_ARG(out != nullptr, "unique id: out is null");
  ncclUniqueId id;
  TM_NCCL_CHECK(nullptr, "unique-id", ncclGetUniqueId(&id));
  std::memcpy(out, id.internal, TM_UNIQUE_ID_BYTES);
  return TM_OK;
}

extern "C" int tm_comm_init_start(const char* name, const char id[TM_UNIQUE_ID_BYTES], int nranks,
                                  int rank, int device, tm_comm_t* out) {
  TM_CHECK_ARG(name && out && id, "comm init: name, id and out must be non-null");
  TM_CHECK_ARG(nranks >= 1 && rank >= 0 && rank < nranks,
               "comm '%s' phase=init: rank %d out of range for %d ranks", name, rank, nranks);
  *out = nullptr;
  tm_comm* c = new (std::nothrow) tm_comm;
  if (!c) return TM_FAIL(TM_E_NOMEM, "comm '%s' phase=init: out of host memory", name);
  c->name = name;
  c->rank = rank;
  c->nranks = nranks;
  c->device = device;
  cudaError_t ce = cudaSetDevice(device);
  if (ce != cudaSuccess) {
    int rc = tmd::fail_cuda(c, "init", "cudaSetDevice", ce, __FILE__, __LINE__);
    delete c;
    return rc;
  }
  ncclUniqueId uid;
  std::memcpy(uid.internal, id, TM_UNIQUE_ID_BYTES);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;               // init returns at once; collectives may return ncclInProgress
  config.commName = c->name.c_str(); // shows up in NCCL's logs (copied by NCCL at init)
  ncclResult_t r = ncclCommInitRankConfig(&c->nccl, nranks, uid, rank, &config);
  if (r != ncclSuccess && r != ncclInProgress) {
    int rc = tmd::fail_nccl(c, "init", "ncclCommInitRankConfig", r, __FILE__, __LINE__);
    if (c->nccl) ncclCommAbort(c->nccl);
    delete c;
    return rc;
  }
  g_created.fetch_add(1);
  // Even when NCCL answers ncclSuccess, READY is set by tm_comm_poll (one path for both).
  c->state = TM_COMM_INITIALIZING;
  *out = c;
  return TM_OK;
}

extern "C" int tm_comm_poll(tm_comm_t c, int* done) {
  TM_CHECK_COMM(c);
  TM_CHECK_ARG(done != nullptr, "%s phase=poll: done is null", describe(c).c_str());
  std::lock_guard<std::mutex> lock(c->mu);
  *done = 0;
  const int s = c->state;
  if (s != TM_COMM_INITIALIZING && s != TM_COMM_READY)
    return TM_FAIL(TM_E_STATE, "%s phase=poll: communicator is %s", describe(c).c_str(),
                   tmd::comm_state_name(s));
  if (tmd::is_fake(c)) {
    *done = 1;
    return TM_OK;
  }
  ncclResult_t async = ncclSuccess;
  TM_NCCL_CHECK(c, "poll", ncclCommGetAsyncError(c->nccl, &async));
  if (async == ncclInProgress) return TM_OK;  // still initializing (or an enqueue settling)
  if (async != ncclSuccess) {
    c->state = TM_COMM_FAILED;
    return tmd::fail_nccl(c, s == TM_COMM_INITIALIZING ? "init" : "poll", "async error", async,
                         __FILE__, __LINE__);
  }
  c->state = TM_COMM_READY;
  *done = 1;
  return TM_OK;
}

extern "C" int tm_comm_wait(tm_comm_t c, int timeout_ms) {
  TM_CHECK_COMM(c);
  TM_CHECK_ARG(timeout_ms >= 0, "%s phase=init: negative timeout", describe(c).c_str());
  const auto start = std::chrono::steady_clock::now();
  const auto deadline = start + std::chrono::milliseconds(timeout_ms);
  auto pause = std::chrono::microseconds(50);
  for (;;) {
    int done = 0;
    TM_CHECK(tm_comm_poll(c, &done));
    if (done) return TM_OK;
    if (std::chrono::steady_clock::now() >= deadline) break;
    backoff(&pause);
  }
  // Phase 1 failed: abort only this half-built communicator; the live ones are untouched.
  std::lock_guard<std::mutex> lock(c->mu);
  const int arc = tmd::abort_locked(c, "init-timeout");
  return TM_FAIL(TM_E_TIMEOUT, "%s phase=init: not ready after %d ms (a member never joined?); %s",
                 describe(c).c_str(), timeout_ms,
                 arc == TM_OK ? "aborted it" : "abort failed too");
}

extern "C" int tm_comm_revoke(tm_comm_t c) {
  TM_CHECK_COMM(c);
  std::lock_guard<std::mutex> lock(c->mu);
  const int s = c->state;
  if (s == TM_COMM_REVOKED) return TM_OK;
  if (s != TM_COMM_READY && s != TM_COMM_FAILED)
    return TM_FAIL(TM_E_STATE, "%s phase=revoke: communicator is %s", describe(c).c_str(),
                   tmd::comm_state_name(s));
  if (tmd::is_fake(c)) {
    c->state = TM_COMM_REVOKED;
    return TM_OK;
  }
#if TM_HAVE_REVOKE
  TM_NCCL_CHECK(c, "revoke", ncclCommRevoke(c->nccl, NCCL_REVOKE_DEFAULT));
  // Non-blocking: ncclInProgress until in-flight work has unwound.
  const int rc = tmd::settle(c, "revoke", c->op_timeout_ms);
  if (rc != TM_OK) return rc;
  c->state = TM_COMM_REVOKED;
  return TM_OK;
#else
  // No ncclCommRevoke before 2.28.7: abort is the only local way to stop in-flight work.
  return tmd::abort_locked(c, "revoke");
#endif
}

extern "C" int tm_comm_abort(tm_comm_t c) {
  TM_CHECK_COMM(c);
  std::lock_guard<std::mutex> lock(c->mu);
  return tmd::abort_locked(c, "abort");
}

extern "C" int tm_comm_destroy(tm_comm_t c) {
  TM_CHECK_COMM(c);
  std::lock_guard<std::mutex> lock(c->mu);
  const int s = c->state;
  if (s == TM_COMM_ABORTED || s == TM_COMM_DESTROYED) return TM_OK;
  if (s == TM_COMM_FAILED || s == TM_COMM_INITIALIZING)
    return tmd::abort_locked(c, "destroy");  // destroy would wait on peers that may be gone
  ncclComm_t nc = c->nccl;
  c->nccl = nullptr;
  c->state = TM_COMM_DESTROYED;
  if (nc) {
    ncclResult_t r = ncclCommDestroy(nc);
    if (r != ncclSuccess && r != ncclInProgress)
      return tmd::fail_nccl(c, "destroy", "ncclCommDestroy", r, __FILE__, __LINE__);
  }
  return TM_OK;
}

extern "C" int tm_comm_release(tm_comm_t c) {
  if (!c) return TM_OK;
  int rc = TM_OK;
  {
    std::lock_guard<std::mutex> lock(c->mu);
    rc = tmd::abort_locked(c, "release");
  }
  delete c;
  return rc;
}

extern "C" int tm_comm_info(tm_comm_t c, int* rank, int* nranks, int* device, int* state) {
  TM_CHECK_COMM(c);
  if (rank) *rank = c->rank;
  if (nranks) *nranks = c->nranks;
  if (device) *device = c->device;
  if (state) *state = c->state;
  return TM_OK;
}

extern "C" int tm_comm_set_op_timeout(tm_comm_t c, int timeout_ms) {
  TM_CHECK_COMM(c);
  TM_CHECK_ARG(timeout_ms > 0, "%s: op timeout must be positive", describe(c).c_str());
  c->op_timeout_ms = timeout_ms;
  return TM_OK;
}

extern "C" int tm_comm_count_created(long long* out) {
  TM_CHECK_ARG(out != nullptr, "count: out is null");
  *out = g_created.load();
  return TM_OK;
}
