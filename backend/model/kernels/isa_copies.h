// The one way a kernel family compiles its vector code per instruction set (isa.h). The family's file defines
// ISA_COPY_FILE (the header holding that code, written once) and the copies it wants (defined as 1):
//   ISA_COPY_NONE          namespace baseline      no target pragma: baseline x86-64           8 lanes (SSE2 halves)
//   ISA_COPY_AVX2          namespace avx2          avx2,fma,f16c                                   8 lanes
//   ISA_COPY_WIDE_ON_AVX2  namespace wide_on_avx2  avx2,fma,f16c                                   16 lanes
//   ISA_COPY_AVX512        namespace avx512        avx512f,avx512bw,avx512vl,avx2,fma,f16c         16 lanes
//   ISA_COPY_AVX512_VNNI   namespace avx512_vnni   the same and avx512vnni                         16 lanes
// then includes this file once, inside its anonymous namespace, after its system headers. Each copy is the file
// included in its namespace under its own `#pragma GCC target` (and push/pop_options, so a copy's `#pragma GCC
// optimize` stays in it), with ISA_LANES (fp32 lanes per vector), ISA_LEVEL (the instructions it may use: an Isa
// value, 0 baseline, 1 AVX2, 2 AVX-512) and ISA_VNNI (0 or 1) defined, and `kIsa` its Isa. The family's entry
// points call `<namespace>::f` for the `isa` they are given, ISA_CALL where a family has the copies none, avx2 and
// avx512. Never the build machine's flags: a copy runs only where best_isa() says the CPU has its instructions.
#ifndef ISA_COPY_FILE
#error "define ISA_COPY_FILE before including isa_copies.h"
#endif

#ifdef ISA_COPY_NONE
#pragma GCC push_options
namespace baseline {
constexpr Isa kIsa = ISA_NONE;
#define ISA_LANES 8
#define ISA_LEVEL 0
#define ISA_VNNI 0
#include ISA_COPY_FILE
#undef ISA_LANES
#undef ISA_LEVEL
#undef ISA_VNNI
}  // namespace baseline
#pragma GCC pop_options
#endif

#if defined(ISA_COPY_AVX2) || defined(ISA_COPY_WIDE_ON_AVX2)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#ifdef ISA_COPY_AVX2
namespace avx2 {
constexpr Isa kIsa = ISA_AVX2;
#define ISA_LANES 8
#define ISA_LEVEL 1
#define ISA_VNNI 0
#include ISA_COPY_FILE
#undef ISA_LANES
#undef ISA_LEVEL
#undef ISA_VNNI
}  // namespace avx2
#endif
#ifdef ISA_COPY_WIDE_ON_AVX2
namespace wide_on_avx2 {
constexpr Isa kIsa = ISA_WIDE_ON_AVX2;
#define ISA_LANES 16
#define ISA_LEVEL 1
#define ISA_VNNI 0
#include ISA_COPY_FILE
#undef ISA_LANES
#undef ISA_LEVEL
#undef ISA_VNNI
}  // namespace wide_on_avx2
#endif
#pragma GCC pop_options
#endif

#ifdef ISA_COPY_AVX512
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")
namespace avx512 {
constexpr Isa kIsa = ISA_AVX512;
#define ISA_LANES 16
#define ISA_LEVEL 2
#define ISA_VNNI 0
#include ISA_COPY_FILE
#undef ISA_LANES
#undef ISA_LEVEL
#undef ISA_VNNI
}  // namespace avx512
#pragma GCC pop_options
#endif

#ifdef ISA_COPY_AVX512_VNNI
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")
namespace avx512_vnni {
constexpr Isa kIsa = ISA_AVX512;
#define ISA_LANES 16
#define ISA_LEVEL 2
#define ISA_VNNI 1
#include ISA_COPY_FILE
#undef ISA_LANES
#undef ISA_LEVEL
#undef ISA_VNNI
}  // namespace avx512_vnni
#pragma GCC pop_options
#endif

// `call` (a function call, unqualified) in the copy for `isa`, of a family with the copies none, avx2 and avx512.
#define ISA_CALL(isa, call) \
  ((isa) == ISA_AVX512 ? avx512::call : (isa) == ISA_AVX2 ? avx2::call : baseline::call)
#undef ISA_COPY_FILE
#undef ISA_COPY_NONE
#undef ISA_COPY_AVX2
#undef ISA_COPY_WIDE_ON_AVX2
#undef ISA_COPY_AVX512
#undef ISA_COPY_AVX512_VNNI
