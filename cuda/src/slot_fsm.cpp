// The slot state machine as one table: (state, event) -> next state. Pure, no NCCL.
#include "slot_fsm.h"

#include "error.h"

namespace {

constexpr int kIllegal = -1;
constexpr int kStates = 4, kEvents = 5;

// Rows: ACTIVE, PREPARED, SWITCHING, CLOSED. Columns: PREPARE, SWITCH, SWITCHED, CANCEL, CLOSE.
constexpr int kTable[kStates][kEvents] = {
    /* ACTIVE    */ {TM_SLOT_PREPARED, kIllegal, kIllegal, kIllegal, TM_SLOT_CLOSED},
    /* PREPARED  */ {kIllegal, TM_SLOT_SWITCHING, kIllegal, TM_SLOT_ACTIVE, TM_SLOT_CLOSED},
    /* SWITCHING */ {kIllegal, kIllegal, TM_SLOT_ACTIVE, kIllegal, kIllegal},
    /* CLOSED    */ {kIllegal, kIllegal, kIllegal, kIllegal, kIllegal},
};

const char* const kStateNames[kStates] = {"ACTIVE", "PREPARED", "SWITCHING", "CLOSED"};
const char* const kEventNames[kEvents] = {"prepare", "switch", "switched", "cancel", "close"};

}  // namespace

namespace tmd {

const char* slot_state_name(int s) { return s >= 0 && s < kStates ? kStateNames[s] : "?"; }
const char* slot_event_name(int e) { return e >= 0 && e < kEvents ? kEventNames[e] : "?"; }

int slot_next(const char* slot, int state, int event, int* next) {
  TM_CHECK_ARG(state >= 0 && state < kStates, "slot '%s': unknown state %d", slot, state);
  TM_CHECK_ARG(event >= 0 && event < kEvents, "slot '%s': unknown event %d", slot, event);
  const int n = kTable[state][event];
  if (n == kIllegal)
    return TM_FAIL(TM_E_STATE, "slot '%s': illegal transition: %s in state %s", slot,
                   slot_event_name(event), slot_state_name(state));
  *next = n;
  return TM_OK;
}

}  // namespace tmd

extern "C" int tm_slot_transition(int state, int event, int* next) {
  TM_CHECK_ARG(next != nullptr, "slot transition: next is null");
  return tmd::slot_next("(table)", state, event, next);
}
