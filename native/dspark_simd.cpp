// Concern: which vector kernels this CPU runs.  The two feature flags DSPARK_DEF's dispatchers read
// (dspark_simd.h), set once while the library loads.  Calls into no other native file.
#include "dspark_simd.h"

#include <cstdlib>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
namespace dspark {
namespace {
bool cpu_has_avx2_fma() {
    __builtin_cpu_init();  // this runs from a static initializer, maybe before libgcc's own
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}
// DSPARK_NO_AVX512 set (non-empty) keeps the AVX2 kernels, e.g. to compare the two
bool cpu_has_avx512() {
    const char * off = std::getenv("DSPARK_NO_AVX512");
    if (off && *off) return false;
    return cpu_has_avx2_fma() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
}
}  // namespace

// external linkage: declared extern in dspark_simd.h
const bool g_avx2   = cpu_has_avx2_fma();
const bool g_avx512 = cpu_has_avx512();
}  // namespace dspark
#endif
