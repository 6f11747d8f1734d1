/* tmdelta: replace a leaving rank's slot in NCCL communicators (TrainMover).
 *
 * Every function returns an int status (tm_status below): 0 is success. On failure
 * tm_last_error() gives a thread-local message that names the communicator or slot, its rank
 * and the phase, and ends with the source file:line that detected the failure.
 *
 * Three parts, in three groups of functions:
 *   tm_plan_*   which groups a migration changes (pure arithmetic; also in libtmdelta_plan.so)
 *   tm_comm_*   communicators: non-blocking init with a deadline, revoke/abort/destroy, collectives
 *   tm_slot_*   a stable logical group whose communicator is replaced in two phases
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
  TM_E_STATE = 2,        /* an illegal state transition (slot or communicator) */
  TM_E_NCCL = 3,         /* NCCL returned an error (the message carries ncclGetLastError) */
  TM_E_CUDA = 4,         /* the CUDA runtime returned an error */
  TM_E_TIMEOUT = 5,      /* a deadline ran out; the message names what was waited for */
  TM_E_NOMEM = 6,        /* host allocation failed */
  TM_E_UNSUPPORTED = 7,  /* the function is not in this build (plan-only library) */
  TM_E_INTERNAL = 8
} tm_status;

#define TM_UNIQUE_ID_BYTES 128 /* == NCCL_UNIQUE_ID_BYTES (checked at compile time) */

/* Thread-local text of the last failure on this thread ("" if none). Never NULL. */
TM_API const char* tm_last_error(void);
/* Version of the NCCL the library was compiled against and the one loaded at run time
 * (NCCL_VERSION_CODE encoding); 0 for both in the plan-only library. */
TM_API int tm_nccl_version(int* compiled, int* runtime);

/* ---- 1. Delta plan (pure; same semantics as trainmover/runtime/plan.py) ------------------
 * Groups in CSR form: group g has global ranks ranks[offsets[g] .. offsets[g+1]) in group-rank
 * order; offsets has ngroups+1 entries, offsets[0] == 0. Each group must be non-empty with
 * distinct non-negative ranks; every leaver must be in some group; nleavers >= 1 (duplicates
 * in leavers are allowed and count once). */

/* changed[g] = 1 if group g contains a leaver, else 0 (changed has ngroups entries). */
TM_API int tm_plan_changed(int ngroups, const int* offsets, const int* ranks,
                           int nleavers, const int* leavers, unsigned char* changed);
/* The changed groups that global `rank` belongs to (a stayer, or a joiner in a leaver's slot),
 * in group order: out_groups[i] is the group index, out_group_ranks[i] the rank's group rank.
 * *out_count is the number found; if it exceeds capacity the call fails with TM_E_INVALID and
 * *out_count says how much room is needed (capacity = ngroups is always enough). */
TM_API int tm_plan_for_rank(int ngroups, const int* offsets, const int* ranks,
                            int nleavers, const int* leavers, int rank,
                            int capacity, int* out_groups, int* out_group_ranks, int* out_count);

/* ---- 2. Communicators ---------------------------------------------------------------------- */
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
 * The handle holds one reference: release it with tm_comm_release. */
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
/* Drops one reference; the last one aborts a still-live communicator and frees the handle. */
TM_API int tm_comm_release(tm_comm_t comm);
TM_API int tm_comm_info(tm_comm_t comm, int* rank, int* nranks, int* device, int* state);
/* Deadline for one enqueue on a non-blocking communicator to settle (default 300000 ms). */
TM_API int tm_comm_set_op_timeout(tm_comm_t comm, int timeout_ms);
/* Communicators this process has started (tm_comm_init_start calls NCCL accepted). */
TM_API int tm_comm_count_created(long long* out);

/* ---- 3. Collectives, enqueued on `stream` (a cudaStream_t) --------------------------------
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

/* ---- 4. Slots: the two-phase switch ----------------------------------------------------------
 *   ACTIVE --prepare--> PREPARED --switch--> SWITCHING --(old revoked+destroyed)--> ACTIVE
 *   PREPARED --cancel--> ACTIVE;  any but SWITCHING --close--> CLOSED
 * Anything else fails with TM_E_STATE naming the slot, the state and the event. */
typedef struct tm_slot* tm_slot_t;

typedef enum {
  TM_SLOT_ACTIVE = 0,
  TM_SLOT_PREPARED = 1,
  TM_SLOT_SWITCHING = 2,
  TM_SLOT_CLOSED = 3
} tm_slot_state;

typedef enum {
  TM_SLOT_EV_PREPARE = 0,
  TM_SLOT_EV_SWITCH = 1,
  TM_SLOT_EV_SWITCHED = 2,
  TM_SLOT_EV_CANCEL = 3,
  TM_SLOT_EV_CLOSE = 4
} tm_slot_event;

/* The slot takes its own reference on `initial` (which must be READY). */
TM_API int tm_slot_create(const char* name, tm_comm_t initial, tm_slot_t* out);
/* Phase 1 result: store a READY replacement; refused if one is already pending. */
TM_API int tm_slot_prepare(tm_slot_t slot, tm_comm_t replacement);
/* Phase 2: the prepared communicator becomes active at once; the old one is then revoked and
 * destroyed (aborted if that fails). Returns TM_OK once the new one is active, even when only
 * the abort fallback could dispose of the old one; an error means the switch did not happen. */
TM_API int tm_slot_switch(tm_slot_t slot);
/* Aborts the prepared communicator; the active one is untouched. */
TM_API int tm_slot_cancel(tm_slot_t slot);
/* *out = the active communicator (borrowed: valid while the slot holds it). */
TM_API int tm_slot_active(tm_slot_t slot, tm_comm_t* out);
TM_API int tm_slot_state_of(tm_slot_t slot, int* state);
/* Closes the slot (aborts a pending replacement, releases the active one) and frees it. */
TM_API int tm_slot_destroy(tm_slot_t slot);
/* The transition table itself (pure; also in libtmdelta_plan.so): *next for (state, event),
 * or TM_E_STATE if the event is illegal in that state. */
TM_API int tm_slot_transition(int state, int event, int* next);

/* ---- Test hook ------------------------------------------------------------------------------
 * A communicator handle with no NCCL communicator behind it, READY at once: lets the slot
 * logic run on machines without a GPU. Collectives on it fail with TM_E_INVALID. */
TM_API int tm_test_comm_fake(const char* name, int rank, int nranks, tm_comm_t* out);

#ifdef __cplusplus
}
#endif
#endif /* TMDELTA_H */
