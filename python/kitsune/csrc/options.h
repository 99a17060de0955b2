// python/kitsune/csrc/options.h — the one place the bridge reads its run-time options.
//
// The bridge's rows of kitsune/options.py's table (read_by="bridge"), by the same
// names (a test checks that the two agree): meanings and defaults are documented
// there and in docs/options.md. Each is read from the environment by option() below
// and nowhere else. A call site keeps its default, as some depend on the machine
// (the VMM's on the number of devices).
#pragma once

namespace bridge {

enum class Opt {
  kReleaseOnGrow,         // every pool the installed allocator makes (allocator.cpp)
  kVmm,                   // the device's pool (allocator.cpp)
  kPinnedReleaseOnGrow,   // the pinned host pool (pinned.cpp)
  kCaptureOrder,          // capture plans' order (capture.cpp)
  kCapplanLog,            // capture plans' log directory (capture.cpp)
  kSegvBacktrace,         // the SIGSEGV handler (debug.cpp)
};

// The option's environment variable (KITSUNE_...).
const char* option_name(Opt o);
// Its value, or nullptr when it is unset or empty. Read when called: a caller that
// reads it once says so.
const char* option(Opt o);
// As an int (atoi of the value), or dflt when unset or empty.
int option_int(Opt o, int dflt);

}  // namespace bridge

