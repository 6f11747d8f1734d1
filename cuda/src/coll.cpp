// Collectives and grouped point-to-point on a tm_comm_t.
//
// Our communicators are non-blocking (config.blocking = 0), chosen so that Phase 1 init never
// blocks a training thread. The price: any NCCL call on them may return ncclInProgress, and
// the next call on the same communicator is only valid once ncclCommGetAsyncError has left
// ncclInProgress. So every enqueue outside a group is followed by tmd::settle (bounded by the
// communicator's op timeout); inside a group, ncclGroupEnd is the call that may be in progress,
// and tm_group_end settles every communicator the group used.
#include <vector>

#include "comm.h"

namespace {

thread_local int g_group_depth = 0;
thread_local std::vector<tm_comm*> g_group_comms;

int usable(tm_comm* c, const char* phase) {
  TM_CHECK_COMM(c);
  if (tmd::is_fake(c))
    return TM_FAIL(TM_E_INVALID, "%s phase=%s: test fake has no NCCL communicator",
                   tmd::describe(c).c_str(), phase);
  const int s = c->state;
  if (s != TM_COMM_READY)
    return TM_FAIL(TM_E_STATE, "%s phase=%s: communicator is %s (wait for init first)",
                   tmd::describe(c).c_str(), phase, tmd::comm_state_name(s));
  return TM_OK;
}

// After an enqueue returned ncclSuccess or ncclInProgress.
int after_enqueue(tm_comm* c, const char* phase, ncclResult_t r) {
  if (g_group_depth > 0) {
    for (tm_comm* x : g_group_comms)
      if (x == c) return TM_OK;
    g_group_comms.push_back(c);
    return TM_OK;
  }
  if (r == ncclSuccess) return TM_OK;
  return tmd::settle(c, phase, c->op_timeout_ms);
}

#define TM_ENQUEUE(c, phase, call)                                                   \
  do {                                                                               \
    TM_CHECK(usable((c), (phase)));                                                  \
    ncclResult_t tm_r_ = (call);                                                     \
    if (tm_r_ != ncclSuccess && tm_r_ != ncclInProgress)                             \
      return ::tmd::fail_nccl((c), (phase), #call, tm_r_, __FILE__, __LINE__);         \
    return after_enqueue((c), (phase), tm_r_);                                       \
  } while (0)

int check_dtype_op(tm_comm* c, const char* phase, int dtype, int op) {
  TM_CHECK_ARG(dtype >= 0 && dtype < ncclNumTypes, "%s phase=%s: unknown dtype %d",
               tmd::describe(c).c_str(), phase, dtype);
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 10, 0)
  const int max_op = ncclAvg;
#else
  const int max_op = ncclMin;
#endif
  TM_CHECK_ARG(op >= 0 && op <= max_op, "%s phase=%s: unknown reduction op %d",
               tmd::describe(c).c_str(), phase, op);
  return TM_OK;
}

}  // namespace

#define DT(x) static_cast<ncclDataType_t>(x)
#define OP(x) static_cast<ncclRedOp_t>(x)
#define ST(x) static_cast<cudaStream_t>(x)

extern "C" int tm_allreduce(tm_comm_t c, const void* sendbuf, void* recvbuf, size_t count,
                            int dtype, int op, void* stream) {
  TM_CHECK_COMM(c);
  TM_CHECK(check_dtype_op(c, "allreduce", dtype, op));
  TM_ENQUEUE(c, "allreduce",
             ncclAllReduce(sendbuf, recvbuf, count, DT(dtype), OP(op), c->nccl, ST(stream)));
}

extern "C" int tm_broadcast(tm_comm_t c, const void* sendbuf, void* recvbuf, size_t count,
                            int dtype, int root, void* stream) {
  TM_CHECK_COMM(c);
  TM_CHECK(check_dtype_op(c, "broadcast", dtype, 0));
  TM_CHECK_ARG(root >= 0 && root < c->nranks, "%s phase=broadcast: root %d out of range",
               tmd::describe(c).c_str(), root);
  TM_ENQUEUE(c, "broadcast",
             ncclBroadcast(sendbuf, recvbuf, count, DT(dtype), root, c->nccl, ST(stream)));
}

extern "C" int tm_allgather(tm_comm_t c, const void* sendbuf, void* recvbuf, size_t sendcount,
                            int dtype, void* stream) {
  TM_CHECK_COMM(c);
  TM_CHECK(check_dtype_op(c, "allgather", dtype, 0));
  TM_ENQUEUE(c, "allgather",
             ncclAllGather(sendbuf, recvbuf, sendcount, DT(dtype), c->nccl, ST(stream)));
}

extern "C" int tm_reduce_scatter(tm_comm_t c, const void* sendbuf, void* recvbuf,
                                 size_t recvcount, int dtype, int op, void* stream) {
  TM_CHECK_COMM(c);
  TM_CHECK(check_dtype_op(c, "reduce_scatter", dtype, op));
  TM_ENQUEUE(c, "reduce_scatter",
             ncclReduceScatter(sendbuf, recvbuf, recvcount, DT(dtype), OP(op), c->nccl,
                               ST(stream)));
}

extern "C" int tm_send(tm_comm_t c, const void* buf, size_t count, int dtype, int peer,
                       void* stream) {
  TM_CHECK_COMM(c);
  TM_CHECK(check_dtype_op(c, "send", dtype, 0));
  TM_CHECK_ARG(peer >= 0 && peer < c->nranks && peer != c->rank,
               "%s phase=send: bad peer %d", tmd::describe(c).c_str(), peer);
  TM_ENQUEUE(c, "send", ncclSend(buf, count, DT(dtype), peer, c->nccl, ST(stream)));
}

extern "C" int tm_recv(tm_comm_t c, void* buf, size_t count, int dtype, int peer,
                       void* stream) {
  TM_CHECK_COMM(c);
  TM_CHECK(check_dtype_op(c, "recv", dtype, 0));
  TM_CHECK_ARG(peer >= 0 && peer < c->nranks && peer != c->rank,
               "%s phase=recv: bad peer %d", tmd::describe(c).c_str(), peer);
  TM_ENQUEUE(c, "recv", ncclRecv(buf, count, DT(dtype), peer, c->nccl, ST(stream)));
}

extern "C" int tm_group_start(void) {
  TM_NCCL_CHECK(nullptr, "group-start", ncclGroupStart());
  ++g_group_depth;
  return TM_OK;
}

extern "C" int tm_group_end(void) {
  if (g_group_depth <= 0) return TM_FAIL(TM_E_STATE, "group end without group start");
  --g_group_depth;
  ncclResult_t r = ncclGroupEnd();
  if (g_group_depth > 0) {
    TM_NCCL_CHECK(nullptr, "group-end (nested)", r);
    return TM_OK;
  }
  std::vector<tm_comm*> comms;
  comms.swap(g_group_comms);
  if (r != ncclSuccess && r != ncclInProgress) {
    const tm_comm* first = comms.empty() ? nullptr : comms.front();
    for (tm_comm* c : comms) c->state = TM_COMM_FAILED;
    return tmd::fail_nccl(first, "group-end", "ncclGroupEnd", r, __FILE__, __LINE__);
  }
  if (r == ncclSuccess) return TM_OK;
  for (tm_comm* c : comms) TM_CHECK(tmd::settle(c, "group-end", c->op_timeout_ms));
  return TM_OK;
}
