// Thread-local last-error text: "tmdelta: <what> [file:line]".
#include "error.h"

#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <string>

namespace {
thread_local std::string g_last_error;
}

namespace tmd {

int fail(int status, const char* file, int line, const char* fmt, ...) {
  char text[1024];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(text, sizeof text, fmt, ap);
  va_end(ap);
  const char* base = std::strrchr(file, '/');
  char where[160];
  std::snprintf(where, sizeof where, " [%s:%d]", base ? base + 1 : file, line);
  g_last_error = std::string("tmdelta: ") + text + where;
  return status;
}

void clear_error() { g_last_error.clear(); }

}  // namespace tmd

extern "C" const char* tm_last_error(void) { return g_last_error.c_str(); }
