// Slots: a stable logical group whose active communicator is replaced in two phases.
// Every state change goes through tmd::slot_next (the table in slot_fsm.cpp).
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <new>
#include <string>

#include "comm.h"
#include "slot_fsm.h"

struct tm_slot {
  std::string name;
  std::mutex mu;
  int state = TM_SLOT_ACTIVE;
  tm_comm* active = nullptr;   // one reference held
  tm_comm* pending = nullptr;  // one reference held while PREPARED
};

namespace {

// Applies `event` under slot->mu; on an illegal event nothing changes.
int step(tm_slot* s, int event) {
  int next = 0;
  TM_CHECK(tmd::slot_next(s->name.c_str(), s->state, event, &next));
  static const bool trace = std::getenv("TM_SLOT_TRACE") != nullptr;  // read once
  if (trace)
    std::fprintf(stderr, "tmdelta: slot '%s': %s -> %s (%s)\n", s->name.c_str(),
                 tmd::slot_state_name(s->state), tmd::slot_state_name(next),
                 tmd::slot_event_name(event));
  s->state = next;
  return TM_OK;
}

int require_ready(const tm_slot* s, tm_comm* c, const char* what) {
  TM_CHECK_ARG(c != nullptr, "slot '%s': %s communicator is null", s->name.c_str(), what);
  const int st = c->state;
  if (st != TM_COMM_READY)
    return TM_FAIL(TM_E_STATE, "slot '%s': %s %s is %s, must be READY", s->name.c_str(), what,
                   tmd::describe(c).c_str(), tmd::comm_state_name(st));
  return TM_OK;
}

}  // namespace

extern "C" int tm_slot_create(const char* name, tm_comm_t initial, tm_slot_t* out) {
  TM_CHECK_ARG(name && out, "slot create: name and out must be non-null");
  *out = nullptr;
  tm_slot* s = new (std::nothrow) tm_slot;
  if (!s) return TM_FAIL(TM_E_NOMEM, "slot '%s': out of host memory", name);
  s->name = name;
  const int rc = require_ready(s, initial, "initial");
  if (rc != TM_OK) {
    delete s;
    return rc;
  }
  tmd::retain(initial);
  s->active = initial;
  *out = s;
  return TM_OK;
}

extern "C" int tm_slot_prepare(tm_slot_t s, tm_comm_t replacement) {
  TM_CHECK_ARG(s != nullptr, "slot handle is null");
  std::lock_guard<std::mutex> lock(s->mu);
  int next = 0;
  TM_CHECK(tmd::slot_next(s->name.c_str(), s->state, TM_SLOT_EV_PREPARE, &next));
  TM_CHECK(require_ready(s, replacement, "replacement"));
  TM_CHECK_ARG(replacement != s->active, "slot '%s': replacement is the active communicator",
               s->name.c_str());
  TM_CHECK_ARG(replacement->rank == s->active->rank && replacement->nranks == s->active->nranks,
               "slot '%s': replacement %s does not keep the slot's rank %d/%d", s->name.c_str(),
               tmd::describe(replacement).c_str(), s->active->rank, s->active->nranks);
  tmd::retain(replacement);
  s->pending = replacement;
  return step(s, TM_SLOT_EV_PREPARE);
}

extern "C" int tm_slot_switch(tm_slot_t s) {
  TM_CHECK_ARG(s != nullptr, "slot handle is null");
  tm_comm* old = nullptr;
  {
    std::lock_guard<std::mutex> lock(s->mu);
    int next = 0;
    TM_CHECK(tmd::slot_next(s->name.c_str(), s->state, TM_SLOT_EV_SWITCH, &next));
    // A replacement that failed since prepare must not become active.
    TM_CHECK(require_ready(s, s->pending, "prepared"));
    old = s->active;
    s->active = s->pending;  // the switch point: from here on the new communicator is active
    s->pending = nullptr;
    TM_CHECK(step(s, TM_SLOT_EV_SWITCH));
  }
  // Outside the lock: revoking may wait for in-flight work; the slot reads SWITCHING meanwhile.
  const int rc = tmd::dispose(old, "switch");
  tm_comm_release(old);
  std::lock_guard<std::mutex> lock(s->mu);
  TM_CHECK(step(s, TM_SLOT_EV_SWITCHED));
  return rc;
}

extern "C" int tm_slot_cancel(tm_slot_t s) {
  TM_CHECK_ARG(s != nullptr, "slot handle is null");
  std::lock_guard<std::mutex> lock(s->mu);
  int next = 0;
  TM_CHECK(tmd::slot_next(s->name.c_str(), s->state, TM_SLOT_EV_CANCEL, &next));
  tm_comm* p = s->pending;
  s->pending = nullptr;
  TM_CHECK(step(s, TM_SLOT_EV_CANCEL));
  const int rc = tm_comm_abort(p);
  tm_comm_release(p);
  return rc;
}

extern "C" int tm_slot_active(tm_slot_t s, tm_comm_t* out) {
  TM_CHECK_ARG(s && out, "slot active: slot and out must be non-null");
  std::lock_guard<std::mutex> lock(s->mu);
  if (s->state == TM_SLOT_CLOSED)
    return TM_FAIL(TM_E_STATE, "slot '%s': closed", s->name.c_str());
  *out = s->active;
  return TM_OK;
}

extern "C" int tm_slot_state_of(tm_slot_t s, int* state) {
  TM_CHECK_ARG(s && state, "slot state: slot and state must be non-null");
  std::lock_guard<std::mutex> lock(s->mu);
  *state = s->state;
  return TM_OK;
}

extern "C" int tm_slot_destroy(tm_slot_t s) {
  if (!s) return TM_OK;
  int rc = TM_OK;
  {
    std::lock_guard<std::mutex> lock(s->mu);
    TM_CHECK(step(s, TM_SLOT_EV_CLOSE));  // refused while SWITCHING: the switch owns the comms
    if (s->pending) {
      rc = tm_comm_abort(s->pending);
      tm_comm_release(s->pending);
      s->pending = nullptr;
    }
    const int rrc = tm_comm_release(s->active);
    if (rc == TM_OK) rc = rrc;
    s->active = nullptr;
  }
  delete s;
  return rc;
}
