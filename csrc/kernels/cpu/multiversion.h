#pragma once
// TDX_MULTIVERSION compiles a hot CPU kernel for AVX-512, AVX2 and the
// baseline ISA and picks one at load time (GCC/Clang ifunc on x86-64), so the
// library stays portable while its vector loops use the machine's full width.
// Helpers a kernel calls must be TDX_INLINE so that they are compiled into
// every clone.

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(__CUDACC__)
#define TDX_MULTIVERSION __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define TDX_MULTIVERSION
#endif

#if defined(__GNUC__) || defined(__clang__)
#define TDX_INLINE inline __attribute__((always_inline))
#else
#define TDX_INLINE inline
#endif
