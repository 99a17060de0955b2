// python/kitsune/csrc/options.cpp — the bridge's options table (options.h).
#include "options.h"

#include <cstdlib>

namespace bridge {
namespace {

struct Row {
  Opt opt;
  const char* name;
};
// One row an option, in Opt's order (checked below); the names are kitsune/options.py's.
constexpr Row kOptions[] = {
    {Opt::kReleaseOnGrow, "KITSUNE_RELEASE_ON_GROW"},
    {Opt::kVmm, "KITSUNE_VMM"},
    {Opt::kPinnedReleaseOnGrow, "KITSUNE_PINNED_RELEASE_ON_GROW"},
    {Opt::kCaptureOrder, "KITSUNE_CAPTURE_ORDER"},
    {Opt::kCapplanLog, "KITSUNE_CAPPLAN_LOG"},
    {Opt::kSegvBacktrace, "KITSUNE_SEGV_BACKTRACE"},
};
constexpr bool in_order() {
  for (int i = 0; i < static_cast<int>(sizeof kOptions / sizeof kOptions[0]); i++)
    if (static_cast<int>(kOptions[i].opt) != i) return false;
  return true;
}
static_assert(in_order(), "kOptions lists the options in Opt's order");

}  // namespace

const char* option_name(Opt o) { return kOptions[static_cast<int>(o)].name; }

const char* option(Opt o) {
  const char* v = std::getenv(option_name(o));
  return v && *v ? v : nullptr;
}

int option_int(Opt o, int dflt) {
  const char* v = option(o);
  return v ? std::atoi(v) : dflt;
}

}  // namespace bridge
