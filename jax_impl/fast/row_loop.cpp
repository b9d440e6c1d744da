// A decode step's float32 products, y = x @ weight.T for a few rows of x, the weight's output rows
// dealt across XLA's threads in blocks: llama.cpp's split of a matrix-vector product, as an XLA
// custom call. jax_impl/fast/row_loop.py builds this file with the system's C++ compiler against the
// FFI headers jaxlib ships (jax.ffi.include_dir()) and registers the handler with jax.ffi.
//
// The threads are XLA's own: the handler asks for the CPU client's intra-op pool (ffi::ThreadPool),
// the pool its dots already run on, so no second pool spins beside it. An OpenMP team inside the call
// was slower than XLA's dot at every shape (docs/BENCH.md): XLA runs a custom call on one of its
// threads, and libgomp's spinning team then shared the cores with XLA's.
//
// The caller and blocks - 1 pool tasks take chunks of rows from one counter until none is left, and the
// caller waits only for chunks another thread has taken: a task the pool starts late finds nothing
// to do, and none is ever waited for before it starts, so a busy pool cannot stall the call.
//
// Numerics: each output is one weight row's dot product with one input row, summed in vector lanes
// (`omp simd reduction` lets the compiler reassociate the sum; fused multiply-adds are allowed). A row
// is never split between threads, so every thread count gives the same bits; no finite-math
// assumption, so an overflow still reaches the output as inf or nan.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

constexpr int64_t CHUNKS_EACH = 4;  // chunks of rows a thread's share is cut into: a late thread still helps

static inline void pause() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();  // a spinning thread's hint to the core (x86's PAUSE)
#endif
}

static void row_products(const float* weight, const float* x, float* y, int64_t rows, int64_t width,
                         int64_t count, int64_t begin, int64_t end) {
  // weight [rows, width] (C order), x [count, width], y [count, rows]: output rows [begin, end)
  for (int64_t row = begin; row < end; ++row) {
    const float* w = weight + row * width;  // read once from memory, then met by every input row from cache
    for (int64_t r = 0; r < count; ++r) {
      const float* in = x + r * width;
      float total = 0.0f;
#pragma omp simd reduction(+ : total)
      for (int64_t k = 0; k < width; ++k) total += w[k] * in[k];
      y[r * rows + row] = total;
    }
  }
}

struct Product {
  // One call's product, shared with the pool's tasks (which may outlive the call: they then find no chunk)
  const float* weight;
  const float* x;
  float* y;
  int64_t rows, width, count, chunks, each;
  std::atomic<int64_t> next{0};  // the next chunk to take
  std::atomic<int64_t> done{0};  // chunks finished

  void take_chunks() {
    for (int64_t chunk = next.fetch_add(1); chunk < chunks; chunk = next.fetch_add(1)) {
      row_products(weight, x, y, rows, width, count, std::min(rows, chunk * each), std::min(rows, (chunk + 1) * each));
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

static ffi::Error RowProductsImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> weight,
                                  ffi::ResultBuffer<ffi::F32> y, int64_t blocks) {
  // x [count, width], weight [rows, width], y [count, rows]; blocks: the threads asked for
  auto dims = weight.dimensions();
  if (dims.size() != 2 || x.element_count() % dims[1] != 0 || y->element_count() != x.element_count() / dims[1] * dims[0])
    return ffi::Error::InvalidArgument("row_products: x [count, in], weight [out, in], y [count, out]");
  auto product = std::make_shared<Product>();
  product->weight = weight.typed_data();
  product->x = x.typed_data();
  product->y = y->typed_data();
  product->rows = dims[0];
  product->width = dims[1];
  product->count = x.element_count() / dims[1];
  product->chunks = std::max<int64_t>(1, std::min(product->rows, blocks * CHUNKS_EACH));
  product->each = (product->rows + product->chunks - 1) / product->chunks;
  for (int64_t helper = 1; helper < blocks; ++helper) pool.Schedule([product] { product->take_chunks(); });
  product->take_chunks();
  while (product->done.load(std::memory_order_acquire) < product->chunks) pause();  // others' last chunks: microseconds
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvportsRowProducts, RowProductsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("blocks"));
