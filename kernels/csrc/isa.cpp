// Runtime ISA selection (see common.h).
#include <atomic>

#include "common.h"

namespace duet {

namespace {

Isa detect() {
  __builtin_cpu_init();
  // __builtin_cpu_supports also checks that the OS saves the wide registers (XCR0).
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
    return Isa::kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Isa::kAvx2;
  return Isa::kScalar;
}

std::atomic<int> g_active{-1};
std::atomic<bool> g_dot_extensions{true};

}  // namespace

Isa best_isa() {
  static const Isa best = detect();
  return best;
}

Isa active_isa() {
  int a = g_active.load(std::memory_order_relaxed);
  if (a < 0) {
    a = static_cast<int>(best_isa());
    g_active.store(a, std::memory_order_relaxed);
  }
  return static_cast<Isa>(a);
}

Isa set_isa(Isa isa) {
  int a = static_cast<int>(isa) < static_cast<int>(best_isa()) ? static_cast<int>(isa)
                                                               : static_cast<int>(best_isa());
  g_active.store(a, std::memory_order_relaxed);
  return static_cast<Isa>(a);
}

bool cpu_has_avx512bf16() {
  static const bool v = best_isa() == Isa::kAvx512 && __builtin_cpu_supports("avx512bf16");
  return v;
}

bool cpu_has_vnni() {
  static const bool v = best_isa() == Isa::kAvx512 && __builtin_cpu_supports("avx512vnni");
  return v;
}

bool dot_extensions_enabled() { return g_dot_extensions.load(std::memory_order_relaxed); }

bool set_dot_extensions(bool on) {
  g_dot_extensions.store(on, std::memory_order_relaxed);
  return on;
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx2: return "avx2";
    default: return "scalar";
  }
}

}  // namespace duet
