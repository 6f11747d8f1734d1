// The test build's entry point (make test -> build/libtmdelta_test.so, compiled with -DTM_TEST):
// a READY communicator handle with no NCCL communicator behind it, so that the handle's state
// logic (revoke, destroy, release, the error messages) is tested on machines without a GPU.
// Collectives on it fail with TM_E_INVALID. The production library (libtmdelta.so) neither
// compiles this file nor has the `fake` field it sets.
#ifndef TM_TEST
#error "test_hook.cpp belongs to the test build only (make test)"
#endif
#include <new>

#include "comm.h"

extern "C" TM_API int tm_test_comm_fake(const char* name, int rank, int nranks, tm_comm_t* out);

extern "C" int tm_test_comm_fake(const char* name, int rank, int nranks, tm_comm_t* out) {
  TM_CHECK_ARG(name && out, "fake comm: name and out must be non-null");
  TM_CHECK_ARG(nranks >= 1 && rank >= 0 && rank < nranks, "fake comm '%s': bad rank", name);
  tm_comm* c = new (std::nothrow) tm_comm;
  if (!c) return TM_FAIL(TM_E_NOMEM, "fake comm '%s': out of host memory", name);
  c->name = name;
  c->rank = rank;
  c->nranks = nranks;
  c->fake = true;
  c->state = TM_COMM_READY;
  *out = c;
  return TM_OK;
}
