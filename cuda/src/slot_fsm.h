// Slot state machine: the transition table (slot_fsm.cpp) and names for messages.
#pragma once

namespace tmd {

// *next = the state after `event` in `state`; TM_E_STATE (naming `slot`) if illegal.
int slot_next(const char* slot, int state, int event, int* next);
const char* slot_state_name(int state);
const char* slot_event_name(int event);

}  // namespace tmd
