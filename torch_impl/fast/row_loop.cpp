// A decode step's float32 products, y = x @ weight.T for a few rows of x, the weight's output rows
// dealt across torch's threads in contiguous blocks: llama.cpp's split of a matrix-vector product.
// torch_impl/fast/row_loop.py builds this file with torch's cpp_extension and calls it through ctypes.
//
// The OpenMP below is torch's own: the library is linked against libgomp.so.1, and the dynamic
// loader hands it the libgomp torch loaded first, so these are torch's intra-op threads, the pool
// its other operations use, not a second pool spinning beside it.
//
// Numerics: each output is one weight row's dot product with one input row, summed in vector lanes
// (`omp simd reduction` lets the compiler reassociate the sum; fused multiply-adds are allowed). A row
// is never split between threads, so every thread count gives the same bits; no finite-math
// assumption, so an overflow still reaches the output as inf or nan.
#include <algorithm>
#include <cstdint>

extern "C" void row_products(const float* weight, const float* x, float* y, int64_t rows, int64_t width,
                             int64_t count, int64_t blocks) {
  // weight [rows, width] (C order), x [count, width], y [count, rows]; blocks: the threads asked for
  const int64_t each = (rows + blocks - 1) / blocks;  // output rows a block holds (the last may hold fewer)
#pragma omp parallel for num_threads(blocks) schedule(static, 1)
  for (int64_t block = 0; block < blocks; ++block) {
    const int64_t end = std::min(rows, (block + 1) * each);
    for (int64_t row = block * each; row < end; ++row) {
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
}
