#pragma once
// A CPU stand-in for the part of the CUDA language and runtime that
// csrc/kernels/cuda uses, so that GoogleTest can compile those kernels with the
// host compiler and run them here, without a GPU.
//
// A launch runs the grid's blocks one after another. A block runs its threads
// as fibers (ucontext) on the calling thread, switching at barriers:
// __syncthreads() is a barrier of the block, __shfl_down_sync() exchanges
// values through a barrier of the warp (32 lanes). A barrier that can never
// complete (a __syncthreads() in divergent code) aborts with a message instead
// of hanging. Between barriers, even blocks run their threads in increasing
// order and odd blocks in decreasing order, so that a missing barrier shows
// whichever thread writes first. __shared__ arrays are function-local
// statics: blocks never run at the same time. Runs are deterministic.
//
// Not emulated: streams (a launch completes before it returns), concurrency
// between blocks, the device memory model (device pointers are host pointers).

#include <math.h>  // exp(float), log(float), INFINITY, as the CUDA math library declares them

#include <ucontext.h>

#include <array>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <type_traits>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static

struct dim3 {
  unsigned int x, y, z;
  dim3(unsigned int x_ = 1, unsigned int y_ = 1, unsigned int z_ = 1) : x(x_), y(y_), z(z_) {}
};

struct alignas(16) uint4 {
  unsigned int x, y, z, w;
};

inline dim3 threadIdx;
inline dim3 blockIdx;
inline dim3 blockDim;
inline dim3 gridDim;

enum cudaError_t { cudaSuccess = 0, cudaErrorInvalidConfiguration = 9 };
struct CUstream_st;
using cudaStream_t = CUstream_st*;

namespace tdx_emulation {

constexpr int kWarpSize = 32;
constexpr unsigned int kMaxThreadsPerBlock = 1024;
constexpr unsigned int kMaxGridX = 2147483647u;
constexpr size_t kFiberStackBytes = 64 * 1024;

inline cudaError_t& last_error() {
  static cudaError_t error = cudaSuccess;
  return error;
}

struct Barrier {
  Barrier(int count_, const char* what_) : count(count_), what(what_) {}
  const int count;
  const char* const what;
  int arrived = 0;
  uint64_t generation = 0;  // completed rounds
};

struct Warp {
  explicit Warp(int lanes) : barrier(lanes, "__shfl_down_sync") {}
  Barrier barrier;
  std::array<std::array<unsigned char, 8>, kWarpSize> slots{};
};

// The threads of one block as fibers, and the scheduler that runs them.
class Block {
 public:
  explicit Block(unsigned int threads) : barrier(static_cast<int>(threads), "__syncthreads"), fibers_(threads) {
    for (unsigned int first = 0; first < threads; first += kWarpSize) {
      const unsigned int lanes = threads - first < kWarpSize ? threads - first : kWarpSize;
      warps.push_back(std::make_unique<Warp>(static_cast<int>(lanes)));
    }
  }

  // Runs body() once on every thread of the block, to completion (again for each block of the grid).
  void run(const std::function<void()>& body) {
    body_ = &body;
    for (Fiber& fiber : fibers_) {
      fiber.stack.resize(kFiberStackBytes);
      getcontext(&fiber.context);
      fiber.context.uc_stack.ss_sp = fiber.stack.data();
      fiber.context.uc_stack.ss_size = fiber.stack.size();
      fiber.context.uc_link = &scheduler_;
      makecontext(&fiber.context, &Block::fiber_entry, 0);
      fiber.finished = false;
      fiber.waiting_on = nullptr;
    }
    for (size_t done = 0; done < fibers_.size();) {
      bool progressed = false;
      done = 0;
      for (size_t i = 0; i < fibers_.size(); ++i) {
        const size_t t = blockIdx.x % 2 == 0 ? i : fibers_.size() - 1 - i;
        Fiber& fiber = fibers_[t];
        if (fiber.finished) {
          ++done;
          continue;
        }
        if (fiber.waiting_on != nullptr && fiber.waiting_on->generation == fiber.waiting_for) continue;
        fiber.waiting_on = nullptr;
        current_ = t;
        threadIdx = dim3(static_cast<unsigned int>(t));
        swapcontext(&scheduler_, &fiber.context);
        progressed = true;
      }
      if (!progressed && done < fibers_.size()) deadlock();
    }
  }

  // Called on a fiber: waits until `count` threads have arrived at `barrier`.
  void arrive_and_wait(Barrier& waited) {
    if (++waited.arrived == waited.count) {
      waited.arrived = 0;
      ++waited.generation;
      return;
    }
    Fiber& fiber = fibers_[current_];
    fiber.waiting_on = &waited;
    fiber.waiting_for = waited.generation;
    swapcontext(&fiber.context, &scheduler_);
  }

  static Block*& current() {
    static Block* block = nullptr;
    return block;
  }

  Barrier barrier;
  std::vector<std::unique_ptr<Warp>> warps;

 private:
  struct Fiber {
    ucontext_t context;
    std::vector<char> stack;
    bool finished = false;
    Barrier* waiting_on = nullptr;
    uint64_t waiting_for = 0;
  };

  static void fiber_entry() {
    Block& block = *current();
    (*block.body_)();
    block.fibers_[block.current_].finished = true;
  }  // returns to the scheduler through uc_link

  [[noreturn]] void deadlock() const {
    for (const Fiber& fiber : fibers_) {
      if (fiber.waiting_on != nullptr) {
        std::fprintf(stderr, "cuda emulation: block %u: threads wait at %s that the others never reach\n",
                     blockIdx.x, fiber.waiting_on->what);
        break;
      }
    }
    std::abort();
  }

  std::vector<Fiber> fibers_;
  ucontext_t scheduler_;
  size_t current_ = 0;
  const std::function<void()>* body_ = nullptr;
};

// kernel<<<grid, block>>>(args...): validates the configuration like the
// runtime (an invalid one sets the last error and runs nothing), then runs it.
template <typename... Params>
struct Launch {
  dim3 grid;
  dim3 block;
  void (*kernel)(Params...);

  template <typename... Args>
  void operator()(Args&&... args) const {
    const bool one_dimensional = grid.y == 1 && grid.z == 1 && block.y == 1 && block.z == 1;
    if (!one_dimensional || grid.x == 0 || grid.x > kMaxGridX || block.x == 0 || block.x > kMaxThreadsPerBlock) {
      last_error() = cudaErrorInvalidConfiguration;
      return;
    }
    const std::function<void()> body = [&] { kernel(args...); };
    blockDim = block;
    gridDim = grid;
    Block context(block.x);
    Block::current() = &context;
    for (unsigned int b = 0; b < grid.x; ++b) {
      blockIdx = dim3(b);
      context.run(body);
    }
    Block::current() = nullptr;
  }
};

template <typename... Params>
Launch<Params...> launch(dim3 grid, dim3 block, cudaStream_t /*stream: a launch completes before it returns*/,
                         void (*kernel)(Params...)) {
  return Launch<Params...>{grid, block, kernel};
}

}  // namespace tdx_emulation

#define TDX_LAUNCH(grid, block, stream, ...) ::tdx_emulation::launch((grid), (block), (stream), __VA_ARGS__)

inline cudaError_t cudaGetLastError() {
  const cudaError_t error = tdx_emulation::last_error();
  tdx_emulation::last_error() = cudaSuccess;
  return error;
}

inline const char* cudaGetErrorString(cudaError_t error) {
  return error == cudaSuccess ? "no error" : "invalid configuration argument";
}

inline void __syncthreads() {
  tdx_emulation::Block& block = *tdx_emulation::Block::current();
  block.arrive_and_wait(block.barrier);
}

// Lane i gets lane i + delta's value; the top `delta` lanes keep their own.
// Only full-warp masks, as the kernels use.
template <typename T>
T __shfl_down_sync(unsigned int mask, T value, unsigned int delta) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= 8, "shuffles move up to 8 bytes");
  if (mask != 0xffffffffu) {
    std::fprintf(stderr, "cuda emulation: __shfl_down_sync supports the full-warp mask only\n");
    std::abort();
  }
  const unsigned int lane = threadIdx.x % tdx_emulation::kWarpSize;
  tdx_emulation::Block& block = *tdx_emulation::Block::current();
  tdx_emulation::Warp& warp = *block.warps[threadIdx.x / tdx_emulation::kWarpSize];
  std::memcpy(warp.slots[lane].data(), &value, sizeof(T));
  block.arrive_and_wait(warp.barrier);
  T result = value;
  if (lane + delta < tdx_emulation::kWarpSize) std::memcpy(&result, warp.slots[lane + delta].data(), sizeof(T));
  block.arrive_and_wait(warp.barrier);  // nobody overwrites a slot before every lane has read
  return result;
}
