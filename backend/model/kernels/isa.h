// What every kernel family shares: the instruction sets our kernels are compiled for, the running CPU's best one,
// and the packed weights' block constants. Each family writes its vector code once and compiles it once per
// instruction set (isa_copies.h); its entry points take an explicit `isa` and call that copy. The choice comes from
// best_isa(): the running CPU's flags, read at run time, never the build machine's, so one build serves every x86
// CPU. Python reads the names from the built module (`isa_names`).
#pragma once
#include <cstdint>

// The values are the Python side's too (kernels.best_isa(), LLM_KERNEL_ISA, the load log): append, never renumber.
enum Isa : int64_t {
  ISA_NONE = 0,          // baseline x86-64: the layer ops' and KV readers' portable copy; no low-bit kernel
  ISA_AVX2 = 1,          // AVX2 + FMA + F16C: 8 fp32 lanes
  ISA_AVX512 = 2,        // AVX-512 F + BW + VL with AVX2 + FMA + F16C: 16 lanes (gguf_int8: VNNI where the CPU has it)
  ISA_WIDE_ON_AVX2 = 3,  // tests only: AVX-512's 16-lane low-bit source built from AVX2 instructions
};
constexpr const char* kIsaNames[] = {"none", "avx2", "avx512", "wide_on_avx2"};
constexpr int64_t kIsaCount = sizeof(kIsaNames) / sizeof(kIsaNames[0]);
static_assert(kIsaCount == ISA_WIDE_ON_AVX2 + 1, "a name per instruction set");

// The best of ISA_NONE, ISA_AVX2 and ISA_AVX512 this CPU runs (detected once, at the first call).
inline int64_t best_isa() {
  static const int64_t best = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("fma"))
      return ISA_AVX512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return ISA_AVX2;  // F16C: every AVX2 CPU
    return ISA_NONE;
  }();
  return best;
}

// AVX-512 VNNI (vpdpbusd), which gguf_int8's AVX-512 copy multiplies with (lowbit_int8.cpp).
inline bool cpu_has_avx512_vnni() {
  static const bool vnni = [] {
    __builtin_cpu_init();
    return best_isa() == ISA_AVX512 && __builtin_cpu_supports("avx512vnni");
  }();
  return vnni;
}

// The instructions a copy runs (ISA_WIDE_ON_AVX2 runs AVX2's), for checking a requested copy against the CPU.
constexpr int64_t isa_instructions(int64_t isa) { return isa == ISA_WIDE_ON_AVX2 ? ISA_AVX2 : isa; }

// The packed low-bit weights' layout (lowbit.cpp): output rows in tiles of kTile, inputs in blocks of kBlock, one
// record per tile and block; Q4_1's record (which gguf_int8 reads too) is d[16] and m[16] in fp16, then the words.
constexpr int kTile = 16;
constexpr int kBlock = 32;
constexpr int kQ4_1RecordBytes = 4 * kTile + kTile * kBlock / 2;
// The tile kernels prefetch the record this many blocks ahead: streamed from memory, the hardware prefetcher alone
// left a one-row pass 1.2-1.5x slower than with it (docs/benchmarks.md).
constexpr int kPrefetchRecords = 6;
