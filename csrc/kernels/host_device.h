#pragma once
// TDX_HOST_DEVICE marks a function that the CPU kernels and the CUDA kernels both evaluate (one definition
// of an element's value for both devices): __host__ __device__ under nvcc, inline elsewhere.

#if defined(__CUDACC__)
#define TDX_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define TDX_HOST_DEVICE inline
#endif
