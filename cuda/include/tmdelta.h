/* tmdelta: NCCL communicators for TrainMover, built ahead of a migration, with deadlines.
 *
 * Every function returns an int status (tm_status below): 0 is success. On failure
 * tm_last_error() gives a thread-local message that names the communicator, its rank
 * and the phase, and ends with the source file:line that detected the failure.
 *
 * Two groups of functions:
 *   tm_comm_*   communicators: non-blocking init with a deadline, revoke/abort/destroy
 *   tm_allreduce ... tm_group_end   collectives and grouped send/recv on them
 * Which groups a migration rebuilds is decided in Python (trainmover/runtime/plan.py); the
 * swap of a group's communicator is done by trainmover/groups/nccl/backend.py.
 *
 * This header includes neither nccl.h nor cuda_runtime.h: dtypes and reduction ops are the
 * integer values of ncclDataType_t / ncclRedOp_t, streams are cudaStream_t passed as void*.
 */
#ifndef TMDELTA_H
#define TMDELTA_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(TMDELTA_BUILD)
#define TM_API __attribute__((visibility("default")))
#else
#define TM_API
#endif

typedef enum {
  TM_OK = 0,
  TM_E_INVALID = 1,      /* a bad argument (null pointer, out-of-range rank, malformed layout) */
  TM_E_STATE = 2,        /* a call on a communicator in the wrong state */
  TM_E_NCCL = 3,         /* NCCL returned an error (the message carries ncclGetLastError) */
  TM_E_CUDA = 4,         /* the CUDA runtime returned an error */
  TM_E_TIMEOUT = 5,      /* a deadline ran out; the message names what was waited for */
  TM_E_NOMEM = 6,        /* host allocation failed */
  TM_E_UNSUPPORTED = 7,  /* not available here (the Python binding: library not built/loadable) */
  TM_E_INTERNAL = 8
} tm_status;

#define TM_UNIQUE_ID_BYTES 128 /* == NCCL_UNIQUE_ID_BYTES (checked at compile time) */

/* Thread-local text of the last failure on this thread ("" if none). Never NULL. */
TM_API const char* tm_last_error(void);
/* Version of the NCCL the library was compiled against and the one loaded at run time
 * (NCCL_VERSION_CODE encoding). */
TM_API int tm_nccl_version(int* compiled, int* runtime);

/* ---- 1. Communicators ---------------------------------------------------------------------- */
typedef struct tm_comm* tm_comm_t;

typedef enum {
  TM_COMM_INITIALIZING = 0, /* ncclCommInitRankConfig issued, not yet ready */
  TM_COMM_READY = 1,        /* usable for collectives */
  TM_COMM_FAILED = 2,       /* an async error or an op deadline: only revoke/abort/destroy remain */
  TM_COMM_REVOKED = 3,      /* ncclCommRevoke done: refuses collectives, may be destroyed */
  TM_COMM_ABORTED = 4,      /* ncclCommAbort done: NCCL resources freed */
  TM_COMM_DESTROYED = 5     /* ncclCommDestroy done: NCCL resources freed */
} tm_comm_state;

TM_API int tm_get_unique_id(char out[TM_UNIQUE_ID_BYTES]);
/* cudaSetDevice(device), then non-blocking ncclCommInitRankConfig (config.blocking = 0,
 * config.commName = name). Returns at once; *out is in TM_COMM_INITIALIZING or TM_COMM_READY.
 * Free the handle with tm_comm_release. */
TM_API int tm_comm_init_start(const char* name, const char id[TM_UNIQUE_ID_BYTES], int nranks,
                              int rank, int device, tm_comm_t* out);
/* *done = 1 once ready. An NCCL async error moves the communicator to TM_COMM_FAILED and
 * returns TM_E_NCCL. On a READY communicator this is a health check. */
TM_API int tm_comm_poll(tm_comm_t comm, int* done);
/* Polls until ready or timeout_ms (>= 0) has passed. On timeout the half-built communicator
 * is aborted (ncclCommAbort) and TM_E_TIMEOUT returned; no other communicator is touched. */
TM_API int tm_comm_wait(tm_comm_t comm, int timeout_ms);
/* Stops in-flight work and refuses new work. NCCL >= 2.28.7: ncclCommRevoke, then waits for
 * quiescence (bounded by the op timeout); older NCCL: falls back to ncclCommAbort. */
TM_API int tm_comm_revoke(tm_comm_t comm);
TM_API int tm_comm_abort(tm_comm_t comm);   /* local, never waits on peers */
TM_API int tm_comm_destroy(tm_comm_t comm); /* ncclCommDestroy; a FAILED communicator is aborted */
/* Frees the handle, aborting a still-live communicator first (abort is local; destroy could
 * wait on peers that are gone). */
TM_API int tm_comm_release(tm_comm_t comm);
TM_API int tm_comm_info(tm_comm_t comm, int* rank, int* nranks, int* device, int* state);
/* Deadline for one enqueue on a non-blocking communicator to settle (default 300000 ms). */
TM_API int tm_comm_set_op_timeout(tm_comm_t comm, int timeout_ms);
/* Communicators this process has started (tm_comm_init_start calls NCCL accepted). */
TM_API int tm_comm_count_created(long long* out);

/* ---- 2. Collectives, enqueued on `stream` (a cudaStream_t) --------------------------------
 * dtype: ncclDataType_t value; op: ncclRedOp_t value (ncclAvg = 4 needs NCCL >= 2.10).
 * Outside a group, a call returns once NCCL has enqueued the work (see README: ncclInProgress). */
TM_API int tm_allreduce(tm_comm_t comm, const void* sendbuf, void* recvbuf, size_t count,
                        int dtype, int op, void* stream);
TM_API int tm_broadcast(tm_comm_t comm, const void* sendbuf, void* recvbuf, size_t count,
                        int dtype, int root, void* stream);
TM_API int tm_allgather(tm_comm_t comm, const void* sendbuf, void* recvbuf, size_t sendcount,
                        int dtype, void* stream);
TM_API int tm_reduce_scatter(tm_comm_t comm, const void* sendbuf, void* recvbuf,
                             size_t recvcount, int dtype, int op, void* stream);
TM_API int tm_send(tm_comm_t comm, const void* buf, size_t count, int dtype, int peer,
                   void* stream);
TM_API int tm_recv(tm_comm_t comm, void* buf, size_t count, int dtype, int peer, void* stream);
/* ncclGroupStart/End (nestable, per thread). tm_group_end settles every communicator used
 * inside the group (each bounded by its op timeout). */
TM_API int tm_group_start(void);
TM_API int tm_group_end(void);

#ifdef __cplusplus
}
#endif
#endif /* TMDELTA_H */
